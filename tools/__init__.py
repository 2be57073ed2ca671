"""LMPool's operator tools (import name ``lmpool_tools``): ``lmpool ps`` lists the pools on
this machine, ``lmpool top`` watches one live. Both only read the pools' state boards
(``lmpool.protocol.state_board``), so they never slow or change a pool.
"""

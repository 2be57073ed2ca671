"""Every route's reservation: what the request will add to its rank's load, held there until
the rank reports it admitted (``lmpool.control.page_table.reservations``).

It reserves the prompt tokens the request must compute there (and their attention pairs),
its context and the tokens it will decode, and the new blocks it needs capped at what the
rank has left, so reservations never promise capacity a rank did not report. A request that
waits on a pull reserves its work deferred: it starts only once the pull ends. Where the ranks
decode shared prefixes once (cascades), its context is what it reads on its own: its prompt
less the prefix it found cached there that other routed prompts share too, where the sequences
in flight there could save a cascade's worth with it (``Limits.cascade_min_saved``; the
pricing's ``QueryTerms.shared``); that prefix it reserves as cascade pairs, which its decode
steps attend in the prefix pass. With ``Limits.cascade_groups`` the rule is the pricing's: the
prefix is read once only where sequences of the request's group (reported there, or reserved)
make a group for it to join. The group is keyed by the shared prefix's last block hash
(``group_key``): the stage settles it on the route (``Route.group``), which the decision carries
to the worker, and each reservation names it (its ``head``), the group it makes or joins.
The prefix and the group are the pricing's own (``Pricer.terms``), read once, when the route
settles (``Route.depth``, ``Route.group``). Joining a group of one, a reservation converts that member
(``Reservation.converted``), as the pricing credits.
"""

from __future__ import annotations

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.pricing.price import Pricer, read_once, request_shape
from lmpool.control.routing.route import Route, RouteStage
from lmpool.protocol.base import attention_pairs, prefill_keys


class Reserve(RouteStage):
    def __init__(self, gbm: GlobalBlockManager, pricer: Pricer) -> None:
        """Reservations by ``pricer``'s rules: its limits' cascades and groups, its terms of a
        request (the prefix it shares, its group) and its count of a group's sequences on a rank."""
        self.gbm = gbm
        self.pricer = pricer
        lim = pricer.limits
        self.cascade_min_saved = lim.cascade_min_saved  # 0: the ranks run no cascades
        self.groups = lim.cascade_groups and lim.cascade_min_saved > 0  # named only where priced

    def settle(self, route: Route) -> None:
        """Where the ranks run cascades, the prefix the request shares and its group, as the pricing
        reads them (``Pricer.terms``): before the decision, which carries the group to the worker."""
        if self.cascade_min_saved:
            terms = self.pricer.terms(route.query, max(route.expected))
            route.depth, route.group = terms.shared // self.gbm.block_size, terms.head

    def record(self, route: Route) -> None:
        query, rank = route.query, route.rank
        _, missing, need = request_shape(query, route.expected[rank], self.gbm.block_size)
        blocks = min(need, max(0, self.gbm.ranks[rank].blocks_available))
        prompt = query.num_prompt_tokens
        # With cascades, the prefix other prompts share is not its own reading: cascade pairs there.
        # Its group, where the pricing reads groups: else the route has none.
        head = route.group
        shared = members = 0
        if self.cascade_min_saved:
            shared = route.depth * self.gbm.block_size
            if self.groups:
                members = self.pricer.sharing(rank, head)
                shared = shared if members else 0
            else:
                shared = read_once(shared, self.gbm.ranks[rank].in_flight_seqs, self.cascade_min_saved)
        cascade = min(prompt - missing, shared)
        # Joining a lone member, it converts it (``Reservation.converted``): the pricing's credit.
        self.gbm.reserve(query.request_id, rank, blocks, missing, attention_pairs(missing, prompt - missing),
                         prompt - cascade, max(1, query.max_tokens), route.waits_on_pull, cascade, head,
                         cascade if members == 1 else 0, prefill_keys(missing, prompt - missing))

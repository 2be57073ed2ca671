"""What a worker reports of its queue: ``new_prefill_tokens`` (Dynamo's prefill term) counts a
queued prompt less the prefix its rank cached when it arrived; ``waiting_prefill_tokens`` counts
every uncomputed prompt token; the prefill of a step launched and not yet read back is reported
apart (``launched_prefill_tokens``)."""

from __future__ import annotations

from array import array

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from lmpool.config.pool import PoolConfig
from lmpool.config.routing import RoutingConfig
from lmpool.engine.core import EngineCore
from lmpool.engine.hashing import chain_hashes
from lmpool.protocol import AbortRequest, AddRequest
from lmpool.protocol.frontend_worker import pack_ids
from lmpool.protocol.spec import WorkerSpec
from lmpool.sampling_params import SamplingParams
from lmpool.worker import main as worker_main
from lmpool.worker.main import Worker

GROUPS = RoutingConfig(cascade_groups=True)  # a pool whose workers list their groups
BLOCK = 8


def add(request_id: str, tokens: list[int], params: SamplingParams, group: bytes | None = None) -> AddRequest:
    """The request as a pool's frontend sends it: its blocks hashed, and the group its route named."""
    return AddRequest(request_id, pack_ids(array("q", tokens)), params, [], chain_hashes(tokens, BLOCK), group)


def test_queued_prompts_count_only_what_their_rank_must_compute(tiny_model):
    pool = PoolConfig.from_options(tiny_model, world_size=1, block_size=BLOCK, num_kv_blocks=64, max_num_seqs=1)
    spec = WorkerSpec(rank=0, epoch=1, frontend_end="unused", control_end="unused", pool=pool)
    core = EngineCore(pool.engine_of(0))
    worker = Worker(spec, core, frontend=None)
    params = SamplingParams(temperature=0, max_tokens=1)
    shared = list(range(1, 4 * BLOCK + 1))
    worker.handle(add("first", shared + [99], params))
    while core.has_unfinished():  # the first request caches the shared prefix's four blocks
        core.step()
    core.step()  # an overlapped engine reads back its last step one call later
    worker.handle(add("hit", shared + [5, 6, 7], params))  # four cached blocks + 3 tokens
    worker.handle(add("cold", [500 + i for i in range(2 * BLOCK)], params))
    load = worker.load()
    assert load.num_waiting == 2
    assert load.waiting_prefill_tokens == (4 * BLOCK + 3) + 2 * BLOCK
    assert load.new_prefill_tokens == 3 + 2 * BLOCK
    assert load.prefill_keys == (4 * BLOCK + 3) + 2 * BLOCK, "each prompt's chunk reads its whole context"


def test_running_sequences_that_decode_as_a_cascade_report_its_prefix_pass_apart(tiny_model):
    """``context_tokens`` is what the running sequences' decode steps read each on its own: with
    cascades on, two sequences sharing four cached blocks attend them in the cascade's prefix
    pass instead, reported as its 2 x 4 blocks of ``cascade_pairs``."""
    contexts = {}
    for cascade in (0, 1):
        pool = PoolConfig.from_options(tiny_model, world_size=1, block_size=BLOCK, num_kv_blocks=64,
                                       cascade_min_saved_tokens=cascade)
        spec = WorkerSpec(rank=0, epoch=1, frontend_end="unused", control_end="unused", pool=pool)
        core = EngineCore(pool.engine_of(0))
        worker = Worker(spec, core, frontend=None)
        shared = list(range(1, 4 * BLOCK + 1))
        worker.handle(add("first", shared + [99], SamplingParams(temperature=0, max_tokens=1)))
        while core.has_unfinished():  # the shared prefix's four blocks, cached
            core.step()
        core.step()
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        worker.handle(add("a", shared + [5, 6, 7], params))
        worker.handle(add("b", shared + [8, 9], params))
        core.step()
        core.step()  # both prefilled (their own tokens), now decoding
        load = worker.load()
        assert load.num_running == 2
        contexts[cascade] = (load.context_tokens, load.cascade_pairs, sum(len(s) for s in core.scheduler.running))
    (plain, none, held), (cascaded, pairs, held_again) = contexts[0], contexts[1]
    assert plain == held and none == 0
    assert pairs == 2 * 4 * BLOCK and cascaded == held_again - pairs


def test_a_worker_reports_the_prefill_it_launched_once_its_queue_no_longer_counts_it(tiny_model):
    """A launched prompt's prefill is reported as launched from when the scheduler counts it as
    computed until its tokens are read back, never also as queued: serial, from its launch;
    overlapped, from the read-back of the step before it (a heartbeat in between sees it queued).
    A CPU computes a step inside its launch, so a CPU engine never reports one; a GPU's launch
    returns at once, which the core is told here (``_synchronous``) to follow the same steps."""
    prompt = list(range(1, 3 * BLOCK + 6))
    n = len(prompt)
    pairs = n * (n + 1) // 2
    for overlapped, on_device in ((True, True), (False, True), (True, False), (False, False)):
        pool = PoolConfig.from_options(tiny_model, world_size=1, block_size=BLOCK, num_kv_blocks=64,
                                       async_scheduling=overlapped)
        spec = WorkerSpec(rank=0, epoch=1, frontend_end="unused", control_end="unused", pool=pool)
        core = EngineCore(pool.engine_of(0))
        core._synchronous = not on_device
        worker = Worker(spec, core, frontend=None)
        worker.handle(add("a", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))

        def reported() -> tuple[int, int, int, int]:
            load = worker.load()
            return (load.waiting_prefill_tokens, load.launched_prefill_tokens, load.launched_attention,
                    load.launched_keys)

        launched = (n, pairs, n) if on_device else (0, 0, 0)
        assert reported() == (n, 0, 0, 0)
        step = core.begin_step()  # the prefill launched (a heartbeat may report while it runs)
        assert reported() == ((n, 0, 0, 0) if overlapped else (0, *launched))
        read_back = core.end_step(step)
        assert len(read_back) == (0 if overlapped else 1)  # overlapped: its token comes one call later
        assert reported() == ((0, *launched) if overlapped else (0, 0, 0, 0))
        core.step()  # the prefill read back, a decode step launched
        assert reported()[1:] == (0, 0, 0)


def test_a_worker_reports_how_many_of_its_sequences_are_of_each_group_their_routes_named(tiny_model):
    """``group_heads``/``group_rows``: the running and waiting sequences by the group each one's
    route named (``AddRequest.group``: its shared prefix's last block hash), most rows first; a
    sequence whose route named none counts under none. Two documents behind one system-prompt
    block are two groups, not one: the key is not the first block. Finished and aborted requests
    leave; a pool that prices no groups keeps none."""
    pool = PoolConfig.from_options(tiny_model, world_size=1, block_size=BLOCK, num_kv_blocks=64, max_num_seqs=2,
                                   routing_config=GROUPS)
    spec = WorkerSpec(rank=0, epoch=1, frontend_end="unused", control_end="unused", pool=pool)
    core = EngineCore(pool.engine_of(0))
    worker = Worker(spec, core, frontend=None)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    system = list(range(1, BLOCK + 1))
    doc_a, doc_b = system + list(range(20, 20 + BLOCK)), system + list(range(40, 40 + BLOCK))
    key_a, key_b = chain_hashes(doc_a, BLOCK)[-1], chain_hashes(doc_b, BLOCK)[-1]
    assert chain_hashes(doc_a, BLOCK)[0] == chain_hashes(doc_b, BLOCK)[0]  # one first block
    asked = [(doc_a + [7], key_a), (doc_b + [8], key_b), (doc_a + [9, 10], key_a), ([3, 4], None),
             (doc_a + [11], key_a), (doc_b + [12], None)]  # the last: its route named none
    for i, (tokens, group) in enumerate(asked):
        worker.handle(add(f"q{i}", tokens, params, group))
    core.step()  # two admitted (running), four waiting
    load = worker.load()
    assert load.num_running == 2 and load.num_waiting == 4
    assert load.group_heads == [key_a, key_b] and load.group_rows == [3, 1]
    assert worker.load().group_heads == load.group_heads  # a report is built, not consumed
    worker.handle(AbortRequest("q0"))
    assert worker.load().group_rows == [2, 1] and "q0" not in worker.groups
    plain_pool = msgspec.structs.replace(pool, routing_config=RoutingConfig(cascade_groups=False))
    plain = Worker(msgspec.structs.replace(spec, pool=plain_pool), EngineCore(plain_pool.engine_of(0)), frontend=None)
    plain.handle(add("p", doc_a + [7], params, key_a))
    assert plain.groups == {} and plain.load().group_heads == []  # a pool that prices no groups
    assert plain.load().num_waiting == 1


def test_queued_members_of_a_group_report_its_prefix_as_the_pairs_they_will_attend(tiny_model):
    """A burst's questions queued behind one document, their routes naming its group, will attend
    it in their group's prefix pass once they decode, as their reservations counted them: the
    report counts that prefix as ``cascade_pairs``, not as context each reads alone (else a
    report landing mid-burst prices the rank as if every queued question read its document on
    its own). A group of one reads it alone, and so does a request whose route named no group.
    A member decoding alone while another of its group waits is counted with its group too: the
    two share the prefix pass from the step the other joins it (as the join's reservation
    converted it)."""
    pool = PoolConfig.from_options(tiny_model, world_size=1, block_size=BLOCK, num_kv_blocks=64, max_num_seqs=1,
                                   cascade_min_saved_tokens=1, routing_config=GROUPS)
    spec = WorkerSpec(rank=0, epoch=1, frontend_end="unused", control_end="unused", pool=pool)
    core = EngineCore(pool.engine_of(0))
    worker = Worker(spec, core, frontend=None)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    doc, other = list(range(1, 4 * BLOCK + 1)), list(range(200, 200 + 2 * BLOCK))
    key, other_key = chain_hashes(doc, BLOCK)[-1], chain_hashes(other, BLOCK)[-1]
    asked = [("a", doc + [5], key), ("b", doc + [6, 7], key), ("lone", other + [8], other_key),
             ("unnamed", doc + [9], None)]
    for request_id, tokens, group in asked:
        worker.handle(add(request_id, tokens, params, group))
    held = sum(len(tokens) for _, tokens, _ in asked)
    load = worker.load()
    assert load.num_waiting == 4
    assert (load.cascade_pairs, load.context_tokens) == (2 * 4 * BLOCK, held - 2 * 4 * BLOCK)
    while not (core.scheduler.running and core.scheduler.running[0].num_computed_tokens >= len(doc) + 1):
        core.step()  # "a" prefilled, decoding alone (one sequence a step); the rest queued
    load = worker.load()
    assert (load.num_running, load.num_waiting) == (1, 3)
    running, queued = len(core.scheduler.running[0]), held - (len(doc) + 1)  # "a" grew by its tokens
    assert (load.cascade_pairs, load.context_tokens) == (2 * 4 * BLOCK, running + queued - 2 * 4 * BLOCK)


def test_among_heads_of_as_many_rows_the_longest_prompt_is_reported_first(tiny_model, monkeypatch):
    """At the report's limit of groups, a group of one with a long prompt (a document's first
    question, which the next ones should join) goes before a short prompt's, whatever came first."""
    monkeypatch.setattr(worker_main, "GROUP_HEADS", 1)
    pool = PoolConfig.from_options(tiny_model, world_size=1, block_size=BLOCK, num_kv_blocks=64, max_num_seqs=2,
                                   routing_config=GROUPS)
    spec = WorkerSpec(rank=0, epoch=1, frontend_end="unused", control_end="unused", pool=pool)
    worker = Worker(spec, EngineCore(pool.engine_of(0)), frontend=None)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    short, doc = list(range(100, 100 + BLOCK)), list(range(1, 3 * BLOCK + 1))
    for i, tokens in enumerate([short + [8], doc + [7]]):
        worker.handle(add(f"q{i}", tokens, params, chain_hashes(tokens, BLOCK)[-1]))
    load = worker.load()
    assert load.group_heads == [chain_hashes(doc, BLOCK)[-1]] and load.group_rows == [1]


def test_a_load_report_from_a_sender_without_group_heads_still_decodes():
    """The heads come last on the wire (an array), then the prefill keys: a report of the fields
    before them decodes, the heads empty and the keys 0."""
    import msgspec

    from lmpool.protocol import LoadReport

    fields = msgspec.structs.fields(LoadReport)
    cut = [f.name for f in fields].index("group_heads")
    before = [(f.name, object, msgspec.field(default_factory=f.default_factory) if f.default is msgspec.NODEFAULT
               else f.default) for f in fields[:cut]]
    OldReport = msgspec.defstruct("OldReport", before, array_like=True)  # every field sent
    report = msgspec.msgpack.decode(msgspec.msgpack.encode(OldReport(num_running=2, launched_attention=9)),
                                    type=LoadReport)
    assert report.launched_attention == 9 and report.group_heads == [] and report.group_rows == []
    assert report.prefill_keys == report.launched_keys == 0
    with_heads = LoadReport(group_heads=[b"h" * 32], group_rows=[3])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(with_heads), type=LoadReport) == with_heads


def test_a_route_decision_or_request_from_a_sender_without_a_group_still_decodes():
    """``group`` comes last on the wire (an array), defaulting to None: a message of the fields
    before it decodes with none; one with a group keeps it."""
    from lmpool.protocol import RouteDecision

    for message, fields in ((RouteDecision, dict(rank=1, reason="r")),
                            (AddRequest, dict(request_id="q", prompt_ids=pack_ids(array("q", [1, 2])),
                                              params=SamplingParams(),
                                              output_token_ids=[], block_hashes=[]))):
        before = [(f.name, object) if f.required else (f.name, object, f.default if f.default is not msgspec.NODEFAULT
                  else msgspec.field(default_factory=f.default_factory))
                  for f in msgspec.structs.fields(message) if f.name != "group"]
        Old = msgspec.defstruct(f"Old{message.__name__}", before, array_like=True, tag=message.__struct_config__.tag)
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(Old(**fields)), type=message)
        assert decoded.group is None and decoded == message(**fields)
        grouped = message(**fields, group=b"g" * 32)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(grouped), type=message) == grouped


DOCS = (list(range(1, 4 * BLOCK + 1)), list(range(500, 500 + 2 * BLOCK)))  # cached: four blocks, two


def handed_over(tiny_model, asked: list[tuple[int | None, int]], groups: bool = True, min_saved: int = 1,
                max_num_seqs: int = 1, decoding: list[tuple[int | None, int]] = ()) -> tuple:
    """A rank that cached ``DOCS``, and requests routed to it through the route's reservation stage
    (``Reserve``) and added to its worker: each a document of ``DOCS`` (None: a cold prompt) and
    its own tokens after it. The ``decoding`` ones first, stepped until they decode (reported);
    then ``asked``. The rank's priced work (``Pricer.work``) while those are reserved, and once
    the worker's report admits them."""
    from lmpool.control.page_table.manager import GlobalBlockManager
    from lmpool.control.pricing.engine_model import EngineModel
    from lmpool.control.pricing.price import Limits, Pricer
    from lmpool.control.pricing.step_model import StepCoefficients
    from lmpool.control.routing.reserve import Reserve
    from lmpool.control.routing.route import Route
    from lmpool.control.topology import Topology
    from lmpool.protocol import RouteQuery
    from lmpool.protocol.kv_events import BlockStored, KVSnapshot

    pool = PoolConfig.from_options(tiny_model, world_size=1, block_size=BLOCK, num_kv_blocks=64,
                                   max_num_seqs=max_num_seqs, cascade_min_saved_tokens=min_saved,
                                   routing_config=RoutingConfig(cascade_groups=groups))
    spec = WorkerSpec(rank=0, epoch=1, frontend_end="unused", control_end="unused", pool=pool)
    core = EngineCore(pool.engine_of(0))
    worker = Worker(spec, core, frontend=None)
    stored = []
    for d, doc in enumerate(DOCS):
        worker.handle(add(f"read{d}", doc + [99], SamplingParams(temperature=0, max_tokens=1)))
        hashes = chain_hashes(doc, BLOCK)
        stored += [BlockStored(h, p, len(stored) + i, 1) for i, (h, p) in enumerate(zip(hashes, [b""] + hashes[:-1]))]
    while core.has_unfinished():  # the documents' blocks, cached
        core.step()
    core.step()
    gbm = GlobalBlockManager(1, BLOCK)
    gbm.register_rank(0, 1, 64)
    gbm.apply_snapshot(0, 1, KVSnapshot(1, stored))
    gbm.update_load(0, 1, worker.load())
    model = EngineModel(1)
    model.ranks[0].reseed(StepCoefficients(base=1e-3, prefill_token=1e-5, attention_pair=1e-9, decode_seq=1e-4,
                                           context_token=1e-6, cascade_pair=1e-8, prefill_key=1e-7))
    limits = Limits(BLOCK, max_num_seqs, 64, False, min_saved, cascade_groups=groups)
    pricer = Pricer(gbm, Topology.virtual(1), model, limits, lambda rank: 0.5)
    reserve = Reserve(gbm, pricer)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def route(requests, first: int) -> list[str]:
        ids = []
        for i, (d, own) in enumerate(requests, first):
            tokens = (DOCS[d] if d is not None else []) + [600 + 40 * i + t for t in range(own)]  # in the vocabulary
            held = len(DOCS[d]) // BLOCK if d is not None else 0
            matched = min(held, (len(tokens) - 1) // BLOCK)
            query = RouteQuery(f"q{i}", chain_hashes(tokens, BLOCK), len(tokens), params.max_tokens)
            chosen = Route(query, None, (0,), [matched], [matched], rank=0)
            reserve.settle(chosen)
            reserve.record(chosen)
            assert worker.handle(add(query.request_id, tokens, params, chosen.group)) == []  # admitted
            ids.append(query.request_id)
        return ids

    gbm.update_load(0, 1, msgspec.structs.replace(worker.load(), admitted=route(decoding, len(asked))))
    while any(s.num_computed_tokens < len(s) - 1 for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    gbm.update_load(0, 1, worker.load())
    ids = route(asked, 0)
    before = pricer.work(0)
    gbm.update_load(0, 1, msgspec.structs.replace(worker.load(), admitted=ids))
    assert gbm.ranks[0].reserved.count == 0
    return before, pricer.work(0)


def test_a_report_of_the_requests_a_rank_reserved_prices_it_as_their_reservations_did(tiny_model):
    """The control plane prices a rank by its last load report plus the reservations of the
    requests routed there since; a report that admits those requests hands their work from the
    one to the other, and the rank's price must not jump there: its queued prefill, its step
    and the decode left are the same before and after. Questions over a document the rank has
    cached, their routes naming its group: each computes its own tokens only (``new_prefill_tokens``,
    not the whole prompt it waits with) and reads the document in its group's prefix pass."""
    before, after = handed_over(tiny_model, [(0, 3)] * 4)
    assert after.seqs == before.seqs == 4
    assert after.queued == before.queued == 4 * 3, "each question computes its own three tokens"
    assert (after.queue, after.step, after.left) == pytest.approx((before.queue, before.step, before.left))


ASKED = st.tuples(st.sampled_from([0, 1, None]), st.integers(1, 2 * BLOCK + 3))


# The cascade threshold (key reads a plan must save): none (cascades off), one pair, and more than a
# group of two saves (the engine plans no cascade for two decoding members of either document, but
# does for both documents' pairs together), where named groups are priced and reported from their
# second member all the same.
MIN_SAVED = st.sampled_from([0, 1, 5 * BLOCK])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ASKED, min_size=1, max_size=6), MIN_SAVED, st.integers(1, 4), st.lists(ASKED, max_size=3))
def test_any_requests_a_rank_reserved_are_priced_alike_once_reported(tiny_model, asked, min_saved, max_num_seqs,
                                                                      decoding):
    """``handed_over`` for any mix of questions over either cached document and cold prompts, beside
    any decoding there already, with cascades priced by groups (the default) at any threshold, or
    no cascades: the rank's queued prefill, its step, its queue's seconds and its decode left are
    the same while reserved and once reported."""
    before, after = handed_over(tiny_model, asked, min_saved=min_saved, max_num_seqs=max(max_num_seqs, len(decoding)),
                                decoding=decoding)
    assert (after.seqs, after.queued) == (before.seqs, before.queued)
    assert (after.queue, after.step, after.left) == pytest.approx((before.queue, before.step, before.left))


async def test_a_request_arrives_when_its_worker_reads_it_not_when_its_engine_takes_it(tiny_model):
    """A request read off the link while a step runs waits for that step in the worker: its arrival
    (``Sequence.arrival_time``, the first token's ``arrived_at``) is the read, so that wait counts in
    its ``queued_s``, and the link's share (``intake_s``) is the link's alone."""
    import time

    pool = PoolConfig.from_options(tiny_model, world_size=1, block_size=BLOCK, num_kv_blocks=64)
    spec = WorkerSpec(rank=0, epoch=1, frontend_end="unused", control_end="unused", pool=pool)
    core = EngineCore(pool.engine_of(0))

    class Link:
        async def messages(self):
            yield add("q", list(range(1, 20)), SamplingParams(temperature=0, max_tokens=2))

    worker = Worker(spec, core, frontend=Link())
    before = time.monotonic()
    await worker.read_frontend()
    read = time.monotonic()
    (msg,) = worker.inbox
    assert worker.handle(msg) == [] and worker.read_at == {}
    assert before <= core.requests["q"].arrival_time <= read  # not the later take


def test_a_rejected_request_leaves_no_read_stamp_for_a_later_one_of_its_id(tiny_model):
    """A request whose prompt the worker rejects (its ids not whole int32s) takes its read stamp
    with it: a later request of the same id arrives when that one is read, not at the first's read."""
    from lmpool.protocol import RequestRejected

    pool = PoolConfig.from_options(tiny_model, world_size=1, block_size=BLOCK, num_kv_blocks=64)
    spec = WorkerSpec(rank=0, epoch=1, frontend_end="unused", control_end="unused", pool=pool)
    worker = Worker(spec, EngineCore(pool.engine_of(0)), frontend=None)
    worker.read_at["q"] = 1.0
    bad = AddRequest("q", b"\x01\x02\x03", SamplingParams(), [], [])
    (rejected,) = worker.handle(bad)
    assert isinstance(rejected, RequestRejected) and worker.read_at == {}

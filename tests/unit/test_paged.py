"""engine/paged.py: the block pool and tables, and a paged step against the slot cache's on
the same script of sequences joining, growing and leaving (blocks reused after a leave)."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm import LocalCommunicator
from shardwise.engine.paged import BLOCK_SIZE, BlockPool, BlockTables, OutOfBlocks, PagedCaches, blocks_for
from shardwise.engine.slots import SlotCaches, StepBatch
from shardwise.engine.text import DEFAULT_MODEL
from shardwise.hf import load_pretrained


@pytest.fixture(scope="module")
def model():
    m, _ = load_pretrained(DEFAULT_MODEL, comm=LocalCommunicator())
    return m.eval()


def test_pool_counts_holders_and_frees_in_order():
    pool = BlockPool(3, block_size=4)
    a, b = pool.allocate(), pool.allocate()
    assert (a, b, pool.num_free) == (0, 1, 1)
    pool.retain(a)  # shared by a second sequence
    assert pool.release(a) is False and pool.release(a) is True
    assert pool.num_free == 2
    with pytest.raises(ValueError, match="block 0 is already free"):
        pool.release(a)
    assert pool.allocate() == 2  # the never-used block before the freed ones: oldest-freed first
    pool.retain(a)  # a free block taken back (a cached prefix)
    assert pool.refs[a] == 1 and pool.num_free == 0
    with pytest.raises(OutOfBlocks, match="all 3 blocks of 4 positions are in use"):
        pool.allocate()
    assert [blocks_for(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_reserve_is_all_or_nothing_and_release_frees(model):
    tables = BlockTables(num_blocks=5, block_size=4)
    tables.reserve({7: 5, 9: 4})  # 2 + 1 blocks
    assert tables.tables == {7: [0, 1], 9: [2]} and tables.pool.num_free == 2
    tables.reserve({7: 8})  # still 2 blocks: nothing new
    assert tables.pool.num_free == 2 and tables.missing({7: 9, 9: 4}) == 1
    with pytest.raises(OutOfBlocks, match="this step needs 3 more blocks; 2 of 5 are free"):
        tables.reserve({7: 12, 9: 12})
    assert tables.tables == {7: [0, 1], 9: [2]} and tables.pool.num_free == 2  # nothing taken
    assert tables.rows([9, 7]).tolist() == [[2, 0], [0, 1]]
    assert tables.release([7, 42]) == 2 and tables.pool.num_free == 4
    caches = PagedCaches(model, num_blocks=5, block_size=4)
    with pytest.raises(ValueError, match=r"do not hold 6 positions in a pool of 5 blocks"):
        caches.forward(model, StepBatch.build([(9, 0, list(range(2, 8)))], tables=tables.rows([9])))
    with pytest.raises(ValueError, match="needs its rows' block tables"):
        caches.forward(model, StepBatch.build([(9, 0, [2])]))


def _script():
    """(step rows, sequences that leave after it): rows are (seq, new ids)."""
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(2, 500, (n,), generator=g).tolist()

    return [
        ([(0, ids(21))], []),  # a prompt longer than one block
        ([(0, ids(1)), (1, ids(5))], []),  # decode + a prompt joining
        ([(0, ids(1)), (1, ids(1))], []),
        ([(1, ids(1)), (0, ids(1)), (2, ids(33))], [0]),  # rows in another order; 0 leaves
        ([(2, ids(1)), (3, ids(17))], []),  # 3 takes the blocks 0 freed
        ([(3, ids(1)), (2, ids(1)), (1, ids(1))], []),
        ([(3, ids(1)), (1, ids(2))], [1, 2, 3]),
    ]


def test_paged_steps_equal_slot_steps(model):
    block = 8  # smaller than the default, so the script crosses many block boundaries
    paged = PagedCaches(model, num_blocks=blocks_for(64, block) * 2, block_size=block)
    tables = BlockTables(paged.num_blocks, block)
    slots = SlotCaches(model, num_slots=4, max_len=64)
    past: dict[int, int] = {}
    for rows, leaving in _script():
        lengths = {s: past.get(s, 0) + len(new) for s, new in rows}
        tables.reserve(lengths)
        batch = StepBatch.build([(s, past.get(s, 0), new) for s, new in rows])
        paged_batch = StepBatch.build(
            [(s, past.get(s, 0), new) for s, new in rows], tables=tables.rows([s for s, _ in rows])
        )
        got, want = paged.forward(model, paged_batch), slots.forward(model, batch)  # (B, V)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        past.update(lengths)
        tables.release(leaving)
        for s in leaving:
            past.pop(s)
    assert tables.tables == {} and tables.pool.num_free == tables.pool.num_blocks


def test_default_block_size_and_bytes(model):
    caches = PagedCaches(model, num_blocks=3)
    assert caches.block_size == BLOCK_SIZE == 16
    assert caches.nbytes == 3 * PagedCaches.bytes_per_block(model)
    cfg = model.cfg
    assert PagedCaches.bytes_per_block(model) == cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4


def _serve(model, waves, max_tokens, *, num_blocks, block_size, num_slots=4, prefix_caching=True):
    """Rank 0's engine loop in one process: the scheduler over a paged pool, each wave of
    prompts submitted once the one before finished -> (tokens per prompt, metrics, tokens fed)."""
    from shardwise.engine.sampling import SamplingParams
    from shardwise.serve.metrics import Metrics
    from shardwise.serve.scheduler import Scheduler, Sequence

    metrics = Metrics(tp=1, slots=num_slots)
    tables = BlockTables(num_blocks, block_size, prefix_caching=prefix_caching)
    caches = PagedCaches(model, num_blocks, block_size)
    sched = Scheduler(num_slots=num_slots, max_queue=16, metrics=metrics, blocks=tables)
    tokens, fed = [], 0
    for prompts in waves:
        outs = [[] for _ in prompts]
        for p, out in zip(prompts, outs, strict=True):
            sched.submit(Sequence(list(p), max_tokens, SamplingParams(), frozenset(), out.append))
        for _ in range(500):
            batch = sched.next_batch()
            if batch is None:
                break
            fed += int(batch.n_new.sum())
            sched.finish_step(caches.forward(model, batch))
        assert not sched.running and not sched.waiting
        assert tables.pool.num_free == num_blocks  # every block back in the pool
        tokens += [[o.token for o in out if o.token is not None] for out in outs]
    return tokens, metrics, fed


def _prompts(*lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in lengths]


def _reference(model, prompts, n):
    from shardwise.engine import generate

    return [generate(model, [p], comm=LocalCommunicator(), max_new_tokens=n).tokens[0] for p in prompts]


def test_scheduler_over_blocks_preempts_and_tokens_do_not_change(model):
    prompts = _prompts(9, 14, 5, 11)
    want = _reference(model, prompts, 12)
    roomy, m, _ = _serve(model, [prompts], 12, num_blocks=64, block_size=4)
    assert roomy == want and m.preemptions == 0
    # 11 blocks of 4 positions hold 44 tokens; the four sequences grow to 17-26 each
    tight, m, _ = _serve(model, [prompts], 12, num_blocks=11, block_size=4)
    assert tight == want and m.preemptions > 0 and m.prefix_hit_tokens > 0


def test_prefix_caching_skips_the_shared_prefill_and_tokens_do_not_change(model):
    (system,) = _prompts(21, seed=2)  # a shared "system prompt": 5 full blocks of 4, and one token
    prompts = [system + tail for tail in _prompts(3, 6, 1, seed=3)]
    want = _reference(model, prompts, 8)
    waves = [prompts[:1], prompts[1:]]  # the first finishes (and caches its blocks) before the others come
    got, m, fed = _serve(model, waves, 8, num_blocks=40, block_size=4)
    off, m_off, fed_off = _serve(model, waves, 8, num_blocks=40, block_size=4, prefix_caching=False)
    assert got == want == off
    assert m.prefix_hit_tokens == 2 * 20 and m_off.prefix_hit_tokens == 0  # 5 blocks each for the 2nd wave
    assert fed == fed_off - 2 * 20  # those tokens were not fed again
    # a preempted sequence re-admitted finds its own blocks still cached
    tight, m, _ = _serve(model, [prompts], 8, num_blocks=15, block_size=4)
    assert tight == want and m.preemptions > 0 and m.prefix_hit_tokens > 0


def test_prefix_keys_follow_everything_before_a_block():
    tables = BlockTables(8, block_size=2)
    tables.reserve({1: 6})
    tables.cache_prefix(1, [5, 6, 7, 8, 9, 10])  # 3 full blocks keyed
    assert tables.share_prefix(2, [5, 6, 7, 8, 0]) == 4  # the first two blocks
    assert tables.tables[2] == tables.tables[1][:2] and tables.pool.refs[tables.tables[1][0]] == 2
    assert tables.share_prefix(3, [7, 8, 9, 10, 0]) == 0  # same tokens, another prefix: no hit
    assert tables.share_prefix(4, [5, 6]) == 0  # the last token is always computed
    tables.release([1, 2])
    assert tables.pool.num_free == 8
    assert tables.share_prefix(5, [5, 6, 7, 8, 9, 10, 11]) == 6  # freed, still cached
    tables.release([5])
    tables.reserve({6: 16})  # every block handed out again: the cache is gone
    tables.release([6])
    assert tables.share_prefix(7, [5, 6, 7, 8, 9]) == 0


def _engine(model, num_blocks, *, prefix_caching=True, num_slots=4):
    from shardwise.serve.metrics import Metrics
    from shardwise.serve.scheduler import Scheduler

    metrics = Metrics(tp=1, slots=num_slots)
    tables = BlockTables(num_blocks, prefix_caching=prefix_caching)
    metrics.blocks_total = metrics.blocks_free = num_blocks
    sched = Scheduler(num_slots=num_slots, max_queue=16, metrics=metrics, blocks=tables)
    return sched, tables, PagedCaches(model, num_blocks), metrics


def _seq(prompt, max_tokens, out):
    from shardwise.engine.sampling import SamplingParams
    from shardwise.serve.scheduler import Sequence

    return Sequence(list(prompt), max_tokens, SamplingParams(), frozenset(), out.append)


def test_a_client_leaving_frees_its_blocks_at_the_next_step(model):
    sched, tables, caches, metrics = _engine(model, 32)
    a, b = (_seq(p, 100, []) for p in _prompts(40, 70))
    for s in (a, b):
        sched.submit(s)
    for _ in range(4):  # both prefilled and decoding
        sched.finish_step(caches.forward(model, sched.next_batch()))
    assert len(tables.tables[b.id]) == blocks_for(70 + 3) and metrics.blocks_free == 32 - 3 - 5
    sched.cancel(b)  # what the HTTP thread does when b's client disconnects
    batch = sched.next_batch()
    assert b.id not in tables.tables and batch.ids.shape[0] == 1  # only a steps on
    assert tables.pool.num_free == 32 - len(tables.tables[a.id]) and metrics.blocks_free == tables.pool.num_free
    sched.finish_step(caches.forward(model, batch))
    sched.cancel(a)
    assert sched.next_batch() is None and tables.pool.num_free == 32 and metrics.blocks_free == 32


def test_a_prefix_hit_makes_the_second_prefill_cheaper(model):
    """The prefill step of a request whose 480-token system prompt is cached against the same
    request without the cache: tokens fed and thread time (16 blocks' worth of work skipped)."""
    import time

    (system,) = _prompts(480, seed=4)
    first, second = system + [7, 8, 9], system + [10, 11]

    def second_prefill(prefix_caching):
        sched, _, caches, metrics = _engine(model, 80, prefix_caching=prefix_caching)
        for prompt in (first, second):
            out = []
            sched.submit(_seq(prompt, 1, out))
            batch = sched.next_batch()
            start = time.thread_time()
            sched.finish_step(caches.forward(model, batch))
            spent = time.thread_time() - start
            assert sched.next_batch() is None and out[0].token is not None  # one token: done
        return int(batch.n_new.sum()), spent, metrics.prefix_hit_tokens, out[0].token

    fed_hit, t_hit, hits, tok_hit = second_prefill(True)
    fed_miss, t_miss, no_hits, tok_miss = second_prefill(False)
    assert (fed_hit, hits, fed_miss, no_hits) == (2, 480, 482, 0) and tok_hit == tok_miss
    assert t_hit < 0.5 * t_miss, f"prefill with a 480-token hit took {t_hit:.4f}s, without {t_miss:.4f}s"

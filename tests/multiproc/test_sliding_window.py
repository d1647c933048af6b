"""Gemma 3 and sliding-window attention, sharded, against transformers.

- Gemma 3 GGUF files (written with the gguf package as llama.cpp's converter writes them) at
  tp 1, 2 and 3 (3: 4 query heads split 2/1/1, the one KV head on every rank; all in make
  test-more): a file of head_dim 256 and every 6th layer global (llama.cpp's defaults)
  against transformers' own GGUF load; one with a layer pattern of its own and linear rope
  scaling on the global layers against transformers on the checkpoint it was written from. A
  Mistral file records its sliding window (llama.attention.sliding_window) and is checked
  against its checkpoint.
- Generation past the window through every engine path: generate() (one KV cache per layer),
  the slot cache and the paged cache under the server's scheduler, at tp 2, and generate() at
  tp 2 x pp 2. Mistral's paged sequences free the blocks their window has left (4-token
  blocks, window 5: a sequence holds at most 2 blocks), and a prompt sharing a prefix with an
  older sequence still reads that prefix's blocks from the prefix cache.

The Gemma 3 safetensors checkpoint at tp 1-4 is in test_hf_models.py (hf_models.TINY["gemma3"]).
"""

from __future__ import annotations

import pytest
import torch

from gguf_files import reference_logits, write_gguf
from helpers import tp_group
from hf_models import greedy, prompts, save_tiny
from measured import record

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF load needs it

TOL = 1e-4
"""Max |logits - transformers| / |transformers| over the real tokens (measured 4e-7 to 6e-7)."""
STEPS = 16
"""Greedy tokens: the 7- and 4-token prompts grow to 23 and 20 positions, far past windows of 4 and 5."""
HEAD_256 = dict(head_dim=256, query_pre_attn_scalar=256, num_hidden_layers=6, layer_types=None, rope_parameters=None)
"""Gemma 3's real head_dim and llama.cpp's defaults: layers 0-4 local, layer 5 global, no rope scaling."""
CASES = {
    # name: (hf_models family, overrides, GGUF file or None, reference: "source" or "gguf")
    "gemma3": ("gemma3", {}, False, "source"),
    "gemma3-gguf": ("gemma3", {"query_pre_attn_scalar": 32}, True, "source"),  # llama.cpp: scale 1/sqrt(head_dim)
    "gemma3-256-gguf": ("gemma3", HEAD_256, True, "gguf"),
    "mistral": ("mistral", {}, False, "source"),
    "mistral-gguf": ("mistral", {}, True, "source"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(name) -> (path, vocab, reference logits on prompts(), greedy tokens (2, STEPS), layers),
    made on first use."""
    root = tmp_path_factory.mktemp("window")
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            family, overrides, gguf, ref = CASES[name]
            hf = save_tiny(family, root / name, overrides=overrides)
            path = write_gguf(hf, root / f"{name}.gguf", "F32") if gguf else hf
            if ref == "gguf":
                model, _ = reference_logits(path, *prompts(2))
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
            vocab = model.config.vocab_size
            ids, mask = prompts(vocab)

            def fwd(i, m, pos):
                return model(input_ids=i, attention_mask=m, position_ids=pos).logits

            with torch.no_grad():
                logits = fwd(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
                tokens = greedy(fwd, ids, mask, steps=STEPS)
            assert len(set(tokens.flatten().tolist())) > 4, f"{name}: greedy tokens should vary"
            cache[name] = (str(path), vocab, logits, tokens, model.config.num_hidden_layers)
        return cache[name]

    return get


def _lists(vocab: int) -> list[list[int]]:
    ids, mask = prompts(vocab)
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]


def _logits_and_tokens(world, cases: list[tuple[str, str, int]]) -> dict:
    from shardwise.hf import load_pretrained

    out = {}
    for key, path, vocab in cases:
        model, _ = load_pretrained(path, comm=tp_group(world))
        ids, mask = prompts(vocab)

        def fwd(i, m, pos, model=model):
            return model(i, attention_mask=m, positions=pos)

        with torch.no_grad():
            logits = fwd(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
            tokens = greedy(fwd, ids, mask, steps=STEPS)
        out[key] = {"logits": logits, "tokens": tokens, "window": model.cfg.sliding_window}
    return out


def _err(a: torch.Tensor, b: torch.Tensor, real: torch.Tensor) -> float:
    return ((a[real] - b[real]).norm() / b[real].norm()).item()


GGUF_CASES = ("gemma3-gguf", "gemma3-256-gguf", "mistral-gguf")


@pytest.mark.parametrize("tp", [pytest.param(tp, marks=pytest.mark.full) for tp in (1, 2, 3)])  # make test-more
def test_gguf_files_match_transformers(rank_pool, models, tp):
    jobs = [(n, models(n)[0], models(n)[1]) for n in GGUF_CASES]
    results = rank_pool.run(_logits_and_tokens, tp, args=(jobs,))
    failures = []
    for name in GGUF_CASES:
        _, vocab, ref, ref_tokens, _ = models(name)
        real = prompts(vocab)[1].bool()
        for rank, r in enumerate(results):
            err = _err(r[name]["logits"], ref, real)
            record("sliding-window-gguf", name, "as written", f"tp{tp}", err, rank=rank)
            if err > TOL:
                failures.append(f"{name} tp={tp} rank {rank}: logits differ from transformers by {err:.2e}")
            if not torch.equal(r[name]["tokens"], ref_tokens):
                failures.append(f"{name} tp={tp} rank {rank}: {r[name]['tokens'].tolist()} != {ref_tokens.tolist()}")
            if r[name]["window"] is None:
                failures.append(f"{name}: the file's sliding window was not read")
    assert not failures, "\n".join(failures)


BLOCK = 4
"""Paged blocks of 4 positions: windows of 4 and 5 leave blocks behind within a few steps."""


def _engine_case(world, path: str, vocab: int) -> dict:
    """Each prompt's greedy tokens through generate(), the slot cache and the paged cache (both
    under the server's scheduler), and the most blocks a paged sequence held."""
    from shardwise.engine import generate
    from shardwise.engine.paged import BlockTables, PagedCaches, kept_window
    from shardwise.engine.sampling import SamplingParams
    from shardwise.engine.slots import SlotCaches
    from shardwise.hf import load_pretrained
    from shardwise.serve.metrics import Metrics
    from shardwise.serve.scheduler import Scheduler, Sequence

    tp = tp_group(world)
    model, _ = load_pretrained(path, comm=tp)
    lists = _lists(vocab)
    out = {"generate": generate(model, lists, comm=tp, max_new_tokens=STEPS).tokens}
    # a third prompt shares the first one's first 4 tokens (a whole block): it comes after the
    # first has left that block behind its window, and shares it from the prefix cache
    lists = [*lists, lists[0][:4] + lists[1]]
    for kind in ("slots", "paged"):
        metrics = Metrics(tp=tp.size, slots=3)
        tables = BlockTables(64, BLOCK, window=kept_window(model.cfg)) if kind == "paged" else None
        caches = PagedCaches(model, 64, BLOCK) if kind == "paged" else SlotCaches(model, 3, 64)
        sched = Scheduler(num_slots=3, max_queue=8, metrics=metrics, blocks=tables)
        outs: list[list] = [[] for _ in lists]
        held = 0
        for i, (p, o) in enumerate(zip(lists, outs, strict=True)):
            sched.submit(Sequence(list(p), STEPS, SamplingParams(), frozenset(), o.append))
            for _ in range(6 if i < 2 else 0):  # the later prompts join running sequences
                sched.finish_step(caches.forward(model, sched.next_batch()))
        for _ in range(200):
            batch = sched.next_batch()
            if batch is None:
                break
            if tables is not None:
                held = max(held, *(sum(b >= 0 for b in t) for t in tables.tables.values()))
            sched.finish_step(caches.forward(model, batch))
        out[kind] = [[o.token for o in seq if o.token is not None] for seq in outs]
        if tables is not None:
            out |= {"held": held, "free": tables.pool.num_free, "hits": metrics.prefix_hit_tokens}
    return out


def _third_reference(models, name: str) -> list[int]:
    """Greedy tokens of the engine case's third prompt, by transformers (the source checkpoint)."""
    family, overrides, _, ref = CASES[name]
    assert ref == "source"
    path, vocab, _, _, _ = models(name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    lists = _lists(vocab)
    ids = torch.tensor([lists[0][:4] + lists[1]])
    with torch.no_grad():
        tokens = greedy(lambda i, m, pos: model(input_ids=i, attention_mask=m, position_ids=pos).logits, ids,
                        torch.ones_like(ids), steps=STEPS)  # fmt: skip
    return tokens[0].tolist()


@pytest.mark.parametrize("names", [("gemma3", "mistral")])
def test_every_engine_path_past_the_window_matches_transformers(rank_pool, models, names):
    failures = []
    for name in names:
        path, vocab, _, ref_tokens, _ = models(name)
        want = [*ref_tokens.tolist(), _third_reference(models, name)]
        for rank, r in enumerate(rank_pool.run(_engine_case, 2, args=(path, vocab))):
            if r["generate"] != want[:2]:
                failures.append(f"{name} rank {rank}: generate {r['generate']} != {want[:2]}")
            for kind in ("slots", "paged"):
                if r[kind] != want:
                    failures.append(f"{name} rank {rank}: {kind} {r[kind]} != {want}")
            if r["free"] != 64:
                failures.append(f"{name} rank {rank}: {64 - r['free']} blocks still held at the end")
            if r["hits"] < BLOCK:
                failures.append(f"{name} rank {rank}: the third prompt shared {r['hits']} prefix tokens")
            # Mistral (window 5) frees what its window left: positions [p - 4, p] span at most
            # 2 blocks of 4; Gemma 3's global layers keep all 6 blocks of a 23-token sequence
            limit = 2 if name == "mistral" else 6
            if r["held"] != limit:
                failures.append(f"{name} rank {rank}: a sequence held at most {r['held']} blocks, expected {limit}")
    assert not failures, "\n".join(failures)


def _staged_tokens(world, path: str, vocab: int, layers: int, tp: int, pp: int) -> dict:
    from shardwise.comm import ParallelDims
    from shardwise.engine import StageForward, generate
    from shardwise.hf import load_pretrained
    from shardwise.pipeline.stage import StageLayout

    mesh = ParallelDims(world_size=world.size, tp=tp, pp=pp).build(world)
    model, _ = load_pretrained(path, comm=mesh.tp, stage=(StageLayout.build(layers, pp), mesh.pp_rank))
    res = generate(model, _lists(vocab), comm=mesh.tp, max_new_tokens=STEPS, stages=StageForward(model, mesh))
    return {"tokens": res.tokens, "layers": model.layer_indices()}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("gemma3", marks=pytest.mark.full),
        pytest.param("gemma3-256-gguf", marks=pytest.mark.full),
        pytest.param("mistral-gguf", marks=pytest.mark.full),
    ],
)
def test_tp2_pp2_generation_past_the_window_matches_transformers(rank_pool, models, name):
    path, vocab, _, ref_tokens, layers = models(name)
    results = rank_pool.run(_staged_tokens, 4, args=(path, vocab, layers, 2, 2))
    for rank, r in enumerate(results):
        assert r["tokens"] == ref_tokens.tolist(), f"{name} rank {rank}: {r['tokens']} != {ref_tokens.tolist()}"
    assert {tuple(r["layers"]) for r in results[:2]} != {tuple(r["layers"]) for r in results[2:]}, (
        "stages split no layers"
    )

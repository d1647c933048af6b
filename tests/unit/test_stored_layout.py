"""What a rank will hold of a GGUF file computed in its own block formats, known before any
rank starts (shardwise.hf.stored): per tensor, the formats and bytes each rank's load then
holds, exactly; the planner's bytes from the file's bytes per weight; a tp that cuts a
row-parallel tensor inside a block refused in one line by the CLI, before any rank starts."""

from __future__ import annotations

import pytest

from gguf_files import write_gguf
from hf_models import save_tiny

pytest.importorskip("gguf")

# 8 q / 4 kv heads of 32, MLP 512: hidden 256 is one K-quant block, so at tp > 1 o_proj's
# input is cut inside it (at tp=3 96/96/64: Q8_0's blocks of 32 still divide that).
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, vocab_size=512)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("stored")
    hf = save_tiny("llama2", root, overrides=SHAPE)
    return {q: write_gguf(hf, root / f"llama.{q}.gguf", q) for q in ("Q8_0", "Q4_K", "F16")}


def _held_by_tensor(model) -> dict[str, dict[str, int]]:
    """{parameter name: {format: bytes}} of a loaded model's BlockWeights and float parameters."""
    from shardwise.kernels import BlockWeight
    from shardwise.layers import model_shard_specs

    out: dict[str, dict[str, int]] = {}
    names = {id(m): n for n, m in model.named_modules()}
    for module in model.modules():
        for attr, v in vars(module).items():
            if isinstance(v, BlockWeight):
                held = out.setdefault(f"{names[id(module)]}.{attr}".lstrip("."), {})
                for p in v.parts:
                    held[p.fmt] = held.get(p.fmt, 0) + p.nbytes
    for name in model_shard_specs(model):
        if name not in out:
            p = model.get_parameter(name)
            out[name] = {"F32": p.numel() * p.element_size()}
    return out


@pytest.mark.parametrize("qtype,tp", [("Q8_0", 1), ("Q8_0", 3), ("Q4_K", 1), ("F16", 2)])
def test_layout_is_what_each_rank_loads(files, qtype, tp):
    from shardwise.comm.dryrun import DryRunCommunicator
    from shardwise.hf import load_pretrained, loaded_config, resolve_model
    from shardwise.hf.stored import by_format, stored_layout

    path = files[qtype]
    cfg = loaded_config(path, resolve_model(path).config)
    assert (cfg.stored_bytes_per_weight > 0) == (qtype != "F16")
    if qtype != "F16":  # each format's share of the matrices' weights (the planner times each on its kernel)
        shares = dict(cfg.stored_formats)
        assert shares[qtype] > 0.5 and sum(shares.values()) == pytest.approx(1.0), shares
    for rank in range(tp):
        predicted = stored_layout(path, cfg, tp=tp, rank=rank)
        model, report = load_pretrained(path, comm=DryRunCommunicator(tp, rank))  # loading runs no collective
        held = _held_by_tensor(model)
        mismatched = {n: (predicted[n], held.get(n)) for n in predicted if predicted[n] != held.get(n)}
        assert not mismatched, mismatched
        assert sum(by_format(predicted).values()) == report.param_bytes
        assert report.bytes_by_format == by_format(predicted)  # what the start-up line shows
        if qtype != "F16":
            assert qtype in by_format(predicted)


def test_planner_counts_the_files_bytes(files):
    from shardwise.hf import loaded_config, resolve_model
    from shardwise.hf.stored import by_format, stored_layout
    from shardwise.planner.footprint import weight_bytes

    for qtype in ("Q8_0", "Q4_K"):
        path = files[qtype]
        plain = resolve_model(path).config
        cfg = loaded_config(path, plain)
        exact = sum(by_format(stored_layout(path, cfg, tp=1)).values())
        assert weight_bytes(cfg, 1, width=4) == pytest.approx(exact, rel=1e-6)  # the file's average, at tp=1 exact
        assert weight_bytes(cfg, 1, width=4) < 0.5 * weight_bytes(plain, 1, width=4)  # not fp32's
        assert weight_bytes(cfg, 1, width=4, quantize="q8_0") == weight_bytes(plain, 1, width=4, quantize="q8_0")


def test_block_cut_refused_before_any_rank(files):
    from processes import run_cli_inline

    out = run_cli_inline("generate", "--model", files["Q4_K"], "--tp", "2", "--prompt-ids", "1,2,3")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "blocks of 256" in lines[0] and "not on a block boundary" in lines[0] and "attn_output" in lines[0]
    assert "columns 0..128" in lines[0]  # where it would cut
    out = run_cli_inline("generate", "--model", files["Q4_K"], "--tp", "3", "--prompt-ids", "1,2,3")
    assert out.returncode == 2 and "2 blocks of weight block=256" in out.stderr  # the MLP: 2 blocks for 3 ranks
    out = run_cli_inline("info", "--model", files["Q8_0"], "--tp", "3")
    assert out.returncode == 0, out.stderr
    assert "Q8_0" in out.stdout and "by format on rank 0" in out.stdout

"""A short check of shardwise's models and engine on a CUDA device (run where a GPU is lent).

    PYTHONPATH=src:tests python scripts/cuda_check.py [--out DIR]

For tiny random checkpoints of several families (dense and mixture-of-experts), built with
transformers: the model loaded by shardwise (tp=1) and moved to the GPU gives the same
logits as on the CPU (fp32, 1e-4) and the same 16 greedy tokens through the KV-cached
engine. Also: the NCCL primitives of shardwise's communicator at world size 1 (one GPU
cannot hold two NCCL ranks). Prints one line per check and
writes a JSON summary; exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

FAMILIES = ("llama3", "qwen3", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe")


def check_family(family: str, root: Path, device: str = "cuda") -> dict:
    from hf_models import prompts, save_tiny
    from shardwise.comm import LocalCommunicator
    from shardwise.engine import generate
    from shardwise.hf import load_pretrained

    path = save_tiny(family, root / family)
    model, report = load_pretrained(path, comm=LocalCommunicator())
    ids, mask = prompts(report.config.vocab_size)
    with torch.no_grad():
        cpu = model(ids, attention_mask=mask)
        cpu_tokens = generate(model, [[1, 2, 3, 4, 5], [7, 8]], comm=LocalCommunicator(), max_new_tokens=16).tokens
        model = model.to(device)
        gpu = model(ids.to(device), attention_mask=mask.to(device)).cpu()
        t0 = time.perf_counter()
        gpu_tokens = generate(model, [[1, 2, 3, 4, 5], [7, 8]], comm=LocalCommunicator(), max_new_tokens=16).tokens
        if device == "cuda":
            torch.cuda.synchronize()
        gen_s = time.perf_counter() - t0
    real = mask.bool()
    diff = (cpu - gpu)[real].abs().max().item()
    ok = diff < 1e-4 and cpu_tokens == gpu_tokens
    return {"family": family, "max_logit_diff": diff, "same_tokens": cpu_tokens == gpu_tokens, "ok": ok,
            "generate_16_s": gen_s}  # fmt: skip


def check_nccl() -> dict:
    """The NCCL primitives behind shardwise's communicator at world size 1 (the public methods
    short-cut a group of one, so the primitives are called directly), on CUDA tensors."""
    import torch.distributed as dist

    from shardwise.comm.torch_dist import init_torch_distributed

    out: dict = {}
    try:
        comm = init_torch_distributed(rank=0, world_size=1, master_port=29517, backend="nccl", timeout_s=60)
        dev = comm.device
        t = torch.arange(6.0, device=dev).reshape(3, 2)
        out["device"] = str(dev)
        out["all_reduce"] = comm._all_reduce(t.clone(), "sum").tolist() == t.tolist()
        out["all_gather"] = comm._all_gather(t, -1).tolist() == t.tolist()
        out["reduce_scatter"] = comm._reduce_scatter(t, 0).tolist() == t.tolist()
        out["broadcast"] = comm._broadcast(t.clone(), 0).tolist() == t.tolist()
        out["all_to_all"] = comm._all_to_all(t, [3], [3]).tolist() == t.tolist()
        out["ok"] = all(out[k] for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"))
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        out.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    results, failed = {"families": []}, 0
    with tempfile.TemporaryDirectory() as tmp:
        for fam in FAMILIES:
            try:
                r = check_family(fam, Path(tmp), args.device)
            except Exception as e:  # noqa: BLE001
                r = {"family": fam, "ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            failed += not r["ok"]
            results["families"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)
            if "trace" in r:
                print(r["trace"], flush=True)
    if args.device == "cuda":
        results["nccl"] = check_nccl()
        failed += not results["nccl"]["ok"]
        print(json.dumps(results["nccl"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cuda_check.json").write_text(json.dumps(results, indent=1))
    print(f"{'PASS' if not failed else 'FAIL'}: {failed} check(s) failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Which GPU defaults make the benchmark model fast: a bare training loop under several settings, each in a fresh process.

The model of the first H100 measurement (CharTransformer dim 1024, 12 layers, 16 heads, context 256, batch 32,
bf16 autocast; 242 GFLOP per sample by its `flops_per_sample()`), trained on SyntheticText by a plain loop (no DDP,
no trainer), in these ways:

  eager      torch.optim.AdamW as the trainer builds it today (foreach), TF32 off: the trainer's CUDA settings today
  fused      fused AdamW and TF32 matmuls
  compile    fused, TF32 and torch.compile(model), with an empty inductor cache (a first start)
  recompile  the same again in a new process with the cache `compile` left (an in-place restart or a new attempt
             that finds the cache)
  graphs     compile with mode="reduce-overhead" (CUDA graphs: the forward and backward replayed without a launch
             per kernel), with the cache the two before left

Each variant runs in a process of its own and reports its start-up by phase (imports, CUDA init, model build,
compile = the first step's time less a warm step's, the first step) and the median ms per step over the timed steps
after a warm-up. MFU = achieved model FLOP/s / the device's dense peak for bf16 (`PEAK_BF16`, by device name;
unknown devices print FLOP/s only).

    PYTHONPATH=common:trainer_image python3 benchmarks/gpu_defaults.py              # on one CUDA device, ~2-3 minutes
    PYTHONPATH=common:trainer_image python3 benchmarks/gpu_defaults.py --device cpu --quick   # checks the script

The last line: `result: eager_mfu=... fused_mfu=... compile_mfu=... compile_s=... recompile_s=... eager_ms=...
fused_ms=... compile_ms=... startup_s=... device=... torch=...`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BEGAN = time.perf_counter()  # before the imports this file makes, for the start-up's "imports" phase

#: Dense bf16 peak FLOP/s (no sparsity) by a substring of the CUDA device name, most specific first.
PEAK_BF16 = [
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
]

VARIANTS = {
    "eager": dict(fused=False, tf32=False, compile=False),
    "fused": dict(fused=True, tf32=True, compile=False),
    "compile": dict(fused=True, tf32=True, compile=True),
    "recompile": dict(fused=True, tf32=True, compile=True),
    "graphs": dict(fused=True, tf32=True, compile=True, mode="reduce-overhead"),
}


def peak_flops(device_name: str) -> float:
    return next((peak for key, peak in PEAK_BF16 if key in device_name), 0.0)


def worker(spec: dict) -> dict:
    phases: dict[str, float] = {}
    import torch

    from trainingrun_trainer.data import SyntheticText
    from trainingrun_trainer.models import CharTransformer
    from trainingrun_trainer.optim import parameter_groups

    phases["imports"] = time.perf_counter() - BEGAN

    mark = time.perf_counter()
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
    torch.backends.cuda.matmul.allow_tf32 = spec["tf32"]
    torch.backends.cudnn.allow_tf32 = spec["tf32"]
    phases["device_init"] = time.perf_counter() - mark

    mark = time.perf_counter()
    torch.manual_seed(0)
    model = CharTransformer(
        dim=spec["dim"], layers=spec["layers"], heads=spec["heads"], context_length=spec["context"]
    ).to(device)
    groups = parameter_groups(model, 0.1, True)
    optimizer = torch.optim.AdamW(groups, lr=3e-4, fused=spec["fused"] or None)
    flops_per_step = model.flops_per_sample() * spec["batch_size"]
    forward = torch.compile(model, mode=spec.get("mode")) if spec["compile"] else model
    data = SyntheticText(num_samples=4096, context_length=spec["context"], seed=0)
    batches = [
        torch.stack([data[(i * spec["batch_size"] + j) % len(data)]["tokens"] for j in range(spec["batch_size"])]).to(
            device
        )
        for i in range(8)
    ]
    phases["model_build"] = time.perf_counter() - mark

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(i: int) -> float:
        began = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["bf16"]):
            loss = forward({"tokens": batches[i % len(batches)]})
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - began

    first = step(0)
    for i in range(1, spec["warmup"]):
        step(i)
    times = [step(i) for i in range(spec["steps"])]
    per_step = statistics.median(times)
    phases["first_step"] = first
    phases["compile"] = max(0.0, first - per_step) if spec["compile"] else 0.0
    flash = None
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = torch.randn(
            2, spec["heads"], spec["context"], spec["dim"] // spec["heads"], device=device, dtype=torch.bfloat16
        )
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            flash = True
        except RuntimeError:
            flash = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_flops(name)
    achieved = flops_per_step / per_step
    return {
        "ms": per_step * 1e3,
        "flops": achieved,
        "mfu": achieved / peak if peak else None,
        "startup_s": sum(value for key, value in phases.items() if key != "compile"),  # compile: in first_step
        "phases": phases,
        "flash_sdpa": flash,
        "device": name,
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="a small model and few steps: checks the script")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant (default 40)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (default: all)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds one variant may take (default 240)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("worker: " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    shape = (
        dict(dim=128, layers=2, heads=4, context=64, batch_size=8)
        if args.quick
        else dict(dim=1024, layers=12, heads=16, context=256, batch_size=32)
    )
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-defaults-") as cache:
        for name in args.variants.split(","):
            spec = dict(
                VARIANTS[name],
                **shape,
                device=args.device,
                bf16=args.device == "cuda",
                warmup=3 if args.quick else 10,
                steps=5 if args.quick else args.steps,
            )
            env = dict(
                os.environ,
                TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                TRITON_CACHE_DIR=os.path.join(cache, "triton"),
            )
            began = time.monotonic()
            try:
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", json.dumps(spec)],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                )
            except subprocess.TimeoutExpired:
                print(f"{name}: timed out after {args.timeout:.0f} s", flush=True)
                continue
            lines = [line for line in out.stdout.splitlines() if line.startswith("worker: ")]
            if out.returncode or not lines:
                print(f"{name}: exited {out.returncode}\n{out.stderr[-3000:]}", flush=True)
                continue
            result = results[name] = json.loads(lines[-1][len("worker: ") :])
            phases = " ".join(f"{key}={value:.2f}" for key, value in result["phases"].items())
            mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a"
            print(
                f"{name:10s} {result['ms']:8.2f} ms/step  {result['flops'] / 1e12:8.3f} TFLOP/s  MFU {mfu:>6s}  "
                f"start-up {result['startup_s']:.1f} s ({phases})  flash_sdpa={result['flash_sdpa']}  "
                f"process {time.monotonic() - began:.0f} s",
                flush=True,
            )

    def field(name: str, key: str, scale: float = 1.0) -> str:
        value = results.get(name, {}).get(key)
        if key == "compile":
            value = results.get(name, {}).get("phases", {}).get("compile")
        return "nan" if value is None else f"{value * scale:.4g}"

    some = next(iter(results.values()), {})
    fields = {
        "eager_mfu": field("eager", "mfu"),
        "fused_mfu": field("fused", "mfu"),
        "compile_mfu": field("compile", "mfu"),
        "compile_s": field("compile", "compile"),
        "recompile_s": field("recompile", "compile"),
        "recompile_startup_s": field("recompile", "startup_s"),
        "graphs_mfu": field("graphs", "mfu"),
        "eager_ms": field("eager", "ms"),
        "fused_ms": field("fused", "ms"),
        "compile_ms": field("compile", "ms"),
        "recompile_ms": field("recompile", "ms"),
        "graphs_ms": field("graphs", "ms"),
        "startup_s": field("eager", "startup_s"),
        "device": str(some.get("device", "none")).replace(" ", "_"),
        "torch": some.get("torch", "none"),
    }
    print("result: " + " ".join(f"{key}={value}" for key, value in fields.items()), flush=True)
    return 0 if len(results) == len(args.variants.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())

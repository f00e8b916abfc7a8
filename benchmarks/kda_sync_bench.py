"""What the KDA diagnostic's syncs cost in a prefill step, and what k3patch's side of the fix costs.

GPU part (needs CUDA and Triton): emulates the prefill hot path. One "step" is 69 KDA "layers";
each layer is a bf16 matmul big enough to keep the stream busy, then the fixture's
gather_initial_states (its Triton kernel included). The fork's code (fixtures/kda-fork-folded)
drains the stream twice per layer; the same tree after `k3patch apply` does not. Reports wall
time per step (host clock around the step, ended by one synchronize) before and after, and
their ratio, for several matmul sizes.

CPU part (runs anywhere, CI included): times classify, the rewrite (plan), apply + revert on a
fixture copy, and `k3patch verify` (import + probe) with an interpreter that has torch.

    python benchmarks/kda_sync_bench.py                 # both parts where CUDA exists
    python benchmarks/kda_sync_bench.py --cpu-only      # the CI part
    options: --sizes 2048,4096,8192 --steps 40 --layers 69 --json OUT --markdown OUT

Numbers are medians; trust ratios over milliseconds (see shared/MEASURED.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
ONLY = ["--only", "kda-gather-diagnostic"]
ENV = "K3_KDA_GATHER_LOG"


def k3patch(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "k3patch", *args], capture_output=True, text=True, env=env
    )


def prepare(workdir: Path, fixture: str = "kda-fork-folded") -> tuple[Path, Path]:
    """A copy of the fork fixture as it is, and one after `k3patch apply`."""
    before, after = workdir / "before", workdir / "after"
    for tree in (before, after):
        shutil.rmtree(tree, ignore_errors=True)
        shutil.copytree(FIXTURES / fixture, tree)
    proc = k3patch("apply", "--vllm", str(after), *ONLY)
    if proc.returncode != 0:
        raise SystemExit(f"k3patch apply failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return before, after


@contextmanager
def vllm_from(root: Path) -> Iterator[None]:
    def purge() -> None:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]

    purge()
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
        purge()


def load_gather(root: Path) -> Callable[..., Any]:
    with vllm_from(root):
        from vllm.model_executor.layers.mamba.ops.gather_initial_states import (
            gather_initial_states,
        )
    return gather_initial_states


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p10_ms": ordered[len(ordered) // 10] * 1e3,
        "p90_ms": ordered[(len(ordered) * 9) // 10] * 1e3,
        "n": len(ordered),
    }


# --------------------------------------------------------------------------------------------
# GPU part


def gpu_part(sizes: list[int], steps: int, layers: int, warmup: int) -> dict[str, Any]:
    os.environ.pop(ENV, None)
    with tempfile.TemporaryDirectory(prefix="kda-bench-") as tmp:
        before_tree, after_tree = prepare(Path(tmp))
        variants = {
            "before (fork)": load_gather(before_tree),
            "after (k3patch)": load_gather(after_tree),
        }
        return _time_variants(variants, sizes, steps, layers, warmup)


def _time_variants(
    variants: dict[str, Callable[..., Any]], sizes: list[int], steps: int, layers: int, warmup: int
) -> dict[str, Any]:
    import torch
    import triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    # A KDA recurrent state pool: 128 slots of 32 heads x 128 x 128 fp32 (2 MiB a slot), and
    # 4 sequences of a prefill batch, one without an initial state.
    state = torch.randn((128, 32, 128, 128), device="cuda", generator=gen)
    indices = torch.tensor([17, 3, 99, 64], dtype=torch.int32, device="cuda")
    has = torch.tensor([True, True, False, True], device="cuda")
    for fn in variants.values():
        fn(state, indices, has)
    torch.cuda.synchronize()

    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers_per_step": layers,
        "steps": steps,
        "warmup_steps": warmup,
        "state_pool": list(state.shape),
        "batch": int(indices.numel()),
        "sizes": {},
    }
    for size in sizes:
        results["sizes"][str(size)] = _time_size(
            size, variants, state, indices, has, steps, layers, warmup, gen
        )
    return results


def _time_size(
    size: int,
    variants: dict[str, Callable[..., Any]],
    state: Any,
    indices: Any,
    has: Any,
    steps: int,
    layers: int,
    warmup: int,
    gen: Any,
) -> dict[str, Any]:
    import torch

    a = torch.randn((size, size), device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn((size, size), device="cuda", dtype=torch.bfloat16, generator=gen)
    c = torch.empty((size, size), device="cuda", dtype=torch.bfloat16)

    def matmul_only() -> None:
        for _ in range(layers):
            torch.matmul(a, b, out=c)

    def with_gather(fn: Callable[..., Any]) -> Callable[[], None]:
        def step() -> None:
            for _ in range(layers):
                torch.matmul(a, b, out=c)
                fn(state, indices, has)

        return step

    runs: dict[str, Callable[[], None]] = {"matmul only (floor)": matmul_only}
    runs.update({name: with_gather(fn) for name, fn in variants.items()})
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(warmup):
        for run in runs.values():
            run()
    torch.cuda.synchronize()
    # Interleaved, so clock and thermal drift fall on every variant alike.
    for _ in range(steps):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            samples[name].append(time.perf_counter() - start)
    row: dict[str, Any] = {name: summary(s) for name, s in samples.items()}
    before = row["before (fork)"]["median_ms"]
    after = row["after (k3patch)"]["median_ms"]
    row["ratio_before_over_after"] = before / after
    row["saved_per_layer_us"] = (before - after) * 1e3 / layers
    return row


# --------------------------------------------------------------------------------------------
# CPU part


def cpu_part(repeat: int, verify_python: str | None) -> dict[str, Any]:
    from k3patch import engine, scan
    from k3patch.registry import select
    from k3patch.tree import locate

    patches = select(only=["kda-gather-diagnostic"])
    timings: dict[str, list[float]] = {
        "classify (scan, no record)": [],
        "plan (rewrite + compile + re-classify)": [],
        "apply + revert (CLI, two processes)": [],
    }
    verify_samples: list[float] = []
    verify_summary = ""
    with tempfile.TemporaryDirectory(prefix="kda-bench-cpu-") as tmp:
        work = Path(tmp)
        tree_dir = work / "tree"
        shutil.copytree(FIXTURES / "kda-fork-folded", tree_dir)
        tree = locate(tree_dir)
        for _ in range(repeat):
            start = time.perf_counter()
            report = scan.scan(tree, patches, use_record=False)
            timings["classify (scan, no record)"].append(time.perf_counter() - start)
            start = time.perf_counter()
            plan = engine.plan(report)
            timings["plan (rewrite + compile + re-classify)"].append(time.perf_counter() - start)
            assert plan.new_texts, "the fixture should be pending"
            start = time.perf_counter()
            applied = k3patch("apply", "--vllm", str(tree_dir), *ONLY)
            reverted = k3patch("revert", "--vllm", str(tree_dir))
            timings["apply + revert (CLI, two processes)"].append(time.perf_counter() - start)
            if applied.returncode != 0 or reverted.returncode != 0:
                raise SystemExit(f"apply/revert failed:\n{applied.stdout}{reverted.stdout}")
        if verify_python:
            assert k3patch("apply", "--vllm", str(tree_dir), *ONLY).returncode == 0
            for _ in range(repeat):
                start = time.perf_counter()
                proc = k3patch(
                    "verify", "--vllm", str(tree_dir), "--python", verify_python, "--json", *ONLY
                )
                verify_samples.append(time.perf_counter() - start)
                if proc.returncode != 0:
                    raise SystemExit(f"verify failed:\n{proc.stdout}{proc.stderr}")
                data = json.loads(proc.stdout)["verify"]["patches"][0]["probe"]
                verify_summary = data["summary"]
    out: dict[str, Any] = {name: summary(s) for name, s in timings.items()}
    if verify_samples:
        out["verify (import + probe, child interpreter)"] = summary(verify_samples)
        out["probe_summary"] = verify_summary
    out["python"] = platform.python_version()
    out["repeat"] = repeat
    return out


def default_verify_python() -> str | None:
    given = os.environ.get("K3PATCH_TEST_VLLM_PYTHON")
    if given:
        return given
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    return sys.executable


# --------------------------------------------------------------------------------------------
# Report


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Command: `{result['command']}`", ""]
    gpu = result.get("gpu_part")
    if gpu:
        lines += [
            f"GPU: {gpu['gpu']} (torch {gpu['torch']}, Triton {gpu['triton']}); "
            f"{gpu['layers_per_step']} layers per step, {gpu['steps']} measured steps per "
            f"variant (interleaved, after {gpu['warmup_steps']} warm-up), state pool "
            f"{gpu['state_pool']} fp32, batch {gpu['batch']}.",
            "",
            "| matmul (bf16, square) | floor: matmul only, ms/step | before (fork), ms/step "
            "| after (k3patch), ms/step | before / after | saved per layer |",
            "|---|---|---|---|---|---|",
        ]
        for size, row in gpu["sizes"].items():
            floor = row["matmul only (floor)"]
            before = row["before (fork)"]
            after = row["after (k3patch)"]
            lines.append(
                f"| {size} | {floor['median_ms']:.3f} | {before['median_ms']:.3f} "
                f"(p10 {before['p10_ms']:.3f}, p90 {before['p90_ms']:.3f}) "
                f"| {after['median_ms']:.3f} "
                f"(p10 {after['p10_ms']:.3f}, p90 {after['p90_ms']:.3f}) "
                f"| {row['ratio_before_over_after']:.2f}x | {row['saved_per_layer_us']:.1f} us |"
            )
        lines.append("")
    cpu = result.get("cpu_part")
    if cpu:
        lines += [
            f"CPU part (Python {cpu['python']}, {cpu['repeat']} runs each, median):",
            "",
            "| step | median | p90 |",
            "|---|---|---|",
        ]
        for name, row in cpu.items():
            if isinstance(row, dict):
                lines.append(f"| {name} | {row['median_ms']:.1f} ms | {row['p90_ms']:.1f} ms |")
        if cpu.get("probe_summary"):
            lines += ["", f"Probe: {cpu['probe_summary']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-only", action="store_true")
    parser.add_argument("--sizes", default="1024,2048,4096,8192")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=69)
    parser.add_argument("--repeat", type=int, default=5, help="CPU part: runs per step")
    parser.add_argument("--verify-python", default=None)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)

    result: dict[str, Any] = {"command": " ".join(["python", *sys.argv])}
    result["cpu_part"] = cpu_part(args.repeat, args.verify_python or default_verify_python())
    if not args.cpu_only:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: pass --cpu-only")
        sizes = [int(s) for s in args.sizes.split(",")]
        result["gpu_part"] = gpu_part(sizes, args.steps, args.layers, args.warmup)
    text = markdown(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True))
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost of the no-op path's bytecode checks (stale unchecked-hash pyc, extension module or
sourceless pyc imported instead of a target) against the same path without them, in one run.

Run by hand:  .venv/bin/python benchmarks/bytecode_check.py TREE_SITE_DIR [--rounds 15]
TREE_SITE_DIR holds `vllm/` already applied (e.g. a copy of ~/.cache/k3patch/trees/0.31.0 after
`k3patch apply`). `state.check_record` is what the fast path of status/apply and the plugin ask;
the floor is the same call with the two checks replaced by no-ops. Rounds alternate the two, and
each side's best round is kept (the machine is shared: the minimum is the least disturbed).
"""

from __future__ import annotations

import argparse
import time

from k3patch import state


def per_call(package_dir: str, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        if state.check_record(package_dir)[0] is None:
            raise SystemExit(f"{package_dir}: no fresh record (apply the tree first)")
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("site")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    package_dir = args.site.rstrip("/") + "/vllm"
    real = (state.stale_bytecode, state.imported_instead)
    with_checks, floor = [], []
    for _ in range(args.rounds):
        state.stale_bytecode, state.imported_instead = real
        with_checks.append(per_call(package_dir, args.calls))
        state.stale_bytecode = lambda source, data: None  # type: ignore[assignment]
        state.imported_instead = lambda source: None  # type: ignore[assignment]
        floor.append(per_call(package_dir, args.calls))
    state.stale_bytecode, state.imported_instead = real
    a, b = min(with_checks), min(floor)
    targets = len(state.registered_targets())
    print(
        f"check_record: {a * 1e6:.0f} us with the bytecode checks, {b * 1e6:.0f} us without "
        f"(floor); ratio {a / b:.3f}; {(a - b) * 1e6 / targets:.1f} us per target ({targets})"
    )


if __name__ == "__main__":
    main()

"""FSDP's backward re-gathers in XLA:GPU's schedule: compiled for 8 mock GPUs, not run.

    PYTHONPATH=. python3 benchmarks/gpu_schedule.py          # a machine with one CUDA GPU
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_schedule.py --cpu   # the same code path on CPU

The model and batch are ``benchmarks/memory.py``'s unrolled one (16 separate 512x512 tanh
layers, Adam, global batch 64, float32). Variants, each lowered and compiled for 8 devices
(``step.lower(*specs).compile()``), never executed:

- ``FSDP prefetch``: ``dp.Trainer(..., sync=dp.sync.FSDP())`` (``prefetch=True``, the
  default: a block's backward re-gather is tied to the cotangent reaching the *next* block);
- ``FSDP no prefetch``: ``dp.sync.FSDP(prefetch=False)`` (tied to the block's own cotangent);
- ``GSPMD competent``: memory.py's competent GSPMD row (``benchmarks/plain_step.py``'s
  jitted step, params and Adam state split along dim 0 by ``NamedSharding``, every layer's
  output constrained to the batch over the devices, every layer under ``jax.checkpoint``
  saving every activation);
- ``GSPMD naive``: the same step without the constraints and checkpoints (memory.py's naive
  row, the stronger plain-JAX baseline on this model in ``docs/benchmarks.md``).

Without ``--cpu`` JAX is given ``jax_mock_gpu_topology="1x8x1"`` before anything else: 8 mock
processes of one GPU each over mock NCCL, so XLA:GPU compiles and schedules the 8-way program
on the one real GPU (its latency-hiding scheduler and async collectives as on 8 GPUs). The
Trainer's state is built abstractly (its ``init`` jitted and compiled only, for its output
shardings), so nothing is placed on the mock devices. XLA's command buffers are turned off
(``--xla_gpu_enable_command_buffer=``) so the entry computation lists the kernels one by one
in their scheduled order, and so is gemm autotuning (``--xla_gpu_autotune_level=0``,
``--xla_gpu_shard_autotuning=false``): with it on, the first program's compile did not end
within 270 s on an H200. ``--cpu``: 8 XLA:CPU devices instead (its collectives are
synchronous, so every overlap window there is empty).

Printed per variant, from ``memory_analysis()`` and the scheduled HLO (``as_text()``):

- ``args``, ``temp``: ``argument_size_in_bytes`` and ``temp_size_in_bytes`` per device;
- the count of each collective op in the entry computation (``all-gather-start`` etc.;
  a synchronous one counts as its start and its done);
- param all-gathers: the all-gathers whose operand comes from model params (walked back
  through the entry, not across collectives; each is labelled by those params) and whose
  result holds them whole; backward re-gathers: those of them that gather params an
  earlier one gathered (without labels: that depend on another all-gather's result);
- for each re-gather, in scheduled order: the compute ops (fusion, custom-call, dot,
  convolution) scheduled strictly between its start and its done (``win``) and how many of
  them are matrix products (``gemm``: a dot, a cuBLAS custom-call, or a fusion containing a
  dot); and ``ahead``: whether it starts before the first matrix product that uses the
  previous re-gather's result (the previous block's backward gemm on its re-gathered params),
  i.e. one block ahead.

``--isolate S`` (the default without ``--cpu``, S = 60) compiles each variant in a child
process stopped after S seconds, so one compile that hangs costs only its own row.

Read on one H200 (jax 0.11.2, the flags above). With XLA's combiners on
(``--xla-combiners``, XLA's default) they merge FSDP's forward gathers (23 all-gathers left
of 47) and its 32 gradient reduce-scatters into one at the end: args+temp 24.11 MiB per
device, as the competent GSPMD row's 24.10 (FSDP: 8.82 on XLA:CPU). With jaxcoll's flags
(``jaxcoll.xla_gpu_flags()``: the combiners off; the default here, and what ``jaxcoll.init``
and ``jaxcoll-run`` set): FSDP 9.27 MiB per device, its ideal (GSPMD competent 22.23, naive
22.22), 47 all-gathers and 32 reduce-scatters, one per block and matrix. Either way the
scheduler starts each backward re-gather just before its own block's gemm (none ahead of
the previous block's: 0/14, with and without prefetch, GSPMD the same; 1 compute op in each
window with the combiners off): the overlap prefetch allows is not taken by XLA:GPU's
scheduler in this compile (autotuning off, mock topology).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cpu", action="store_true", help="8 XLA:CPU devices, no mock GPUs")
parser.add_argument(
    "--xla-combiners",
    action="store_true",
    help="keep XLA:GPU's collective combiners on (jaxcoll's flags turn them off)",
)
parser.add_argument("--dump", default=None, help="folder to write each variant's HLO text to")
parser.add_argument(
    "--isolate",
    type=float,
    default=None,
    metavar="S",
    help="compile each variant in a process of its own, stopped after S seconds "
    "(default without --cpu: 60)",
)
parser.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one variant, as a child
args = parser.parse_args()

import jax  # noqa: E402

MOCK = "cpu"
if not args.cpu:
    # Before any other JAX call: 1 slice x 8 hosts x 1 GPU each, mock NCCL.
    try:
        jax.config.update("jax_mock_gpu_topology", "1x8x1")
        MOCK = "jax_mock_gpu_topology=1x8x1"
    except (AttributeError, KeyError):  # a JAX without it: 8 mock processes of its GPUs
        jax.config.update("mock_num_gpu_processes", 8)
        MOCK = "mock_num_gpu_processes=8"

# memory.py parses its own command line and sets jaxcoll's XLA:CPU flags when imported.
_argv, _flags = sys.argv, os.environ.get("XLA_FLAGS")
sys.argv = [sys.argv[0]]
import memory  # noqa: E402

import jaxcoll  # noqa: E402

sys.argv = _argv
#: XLA:GPU flags: no command buffers (the entry lists the kernels in their scheduled order);
#: autotuning off and not sharded over the (mock) processes, which the compile would wait on.
GPU_FLAGS = (
    "--xla_gpu_enable_command_buffer=",
    "--xla_gpu_autotune_level=0",
    "--xla_gpu_shard_autotuning=false",
)
if not args.cpu:
    # jaxcoll's XLA:GPU flags (its collective combiners off), as jaxcoll.init and jaxcoll-run
    # set them, unless --xla-combiners; flags of the environment win.
    ours = [] if args.xla_combiners else jaxcoll.xla_gpu_flags()
    given = {f.split("=", 1)[0] for f in (_flags or "").split()}
    ours = [f for f in ours if f.split("=", 1)[0] not in given]
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [_flags or "", *ours, *GPU_FLAGS]))

import hlo_stats  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import plain_step  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll import dp  # noqa: E402

DEVICES = 8
MIB = 2**20
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


# ------------------------------------------------------------------------------ the programs
def batch_arrays() -> dict:
    rng = np.random.default_rng(1)
    shape = (memory.BATCH, memory.WIDTH)
    return {
        "x": rng.normal(size=shape).astype(np.float32),
        "y": rng.normal(size=shape).astype(np.float32),
    }


def fsdp_compiled(params, batch, sync):
    """``(compiled step, its argument specs)`` of the Trainer's step under ``sync``."""
    trainer = dp.Trainer(memory.unrolled_loss, optax.adam(memory.LR), sync=sync)
    init = jax.jit(lambda: trainer.init(params, jax.random.key(0))).lower()
    shardings = init.compile().output_shardings
    state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        init.out_info,
        shardings,
    )
    step, specs = trainer.step_program(state, batch)
    return step.lower(*specs).compile(), specs


def gspmd_compiled(params, batch, competent: bool):
    """memory.py's GSPMD row (competent or naive): ``(compiled step, its argument specs)``."""
    opt = optax.adam(memory.LR)
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))

    def spec(x) -> P:  # memory.py's unrolled split: dim 0, scalars replicated
        return P("fsdp") if np.ndim(x) >= 1 else P()

    def abstract(tree):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                np.shape(x), x.dtype, sharding=NamedSharding(mesh, spec(x))
            ),
            tree,
        )

    p_spec = abstract(params)
    o_spec = abstract(jax.eval_shape(opt.init, params))
    b_spec = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("fsdp"))),
        batch,
    )
    step = plain_step.jit_step(
        memory.unrolled_loss,
        opt,
        jax.tree.map(lambda s: s.sharding, p_spec),
        jax.tree.map(lambda s: s.sharding, o_spec),
        NamedSharding(mesh, P("fsdp")),
        NamedSharding(mesh, P()),
    )
    memory.ACT[0] = NamedSharding(mesh, P("fsdp", None)) if competent else None
    try:
        lowered = step.lower(p_spec, o_spec, b_spec)
    finally:
        memory.ACT[0] = None
    return lowered.compile(), (p_spec, o_spec, b_spec)


# ------------------------------------------------------------------------------- the schedule
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_PARAM = re.compile(r"\bparameter\((\d+)\)")


def _operands(rest: str) -> list[str]:
    """The operand names of an instruction, from the text after its ``opcode(``."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += ch in "({[" and 1 or 0
        depth -= ch in ")}]" and 1 or 0
        if depth == 0:
            end = i
            break
    names, depth, piece = [], 0, ""
    for ch in rest[:end] + ",":
        if ch == "," and depth == 0:
            token = piece.strip().split()
            if token:
                names.append(token[-1].lstrip("%"))
            piece = ""
            continue
        depth += ch in "({[" and 1 or 0
        depth -= ch in ")}]" and 1 or 0
        piece += ch
    return names


def parse(text: str):
    """``(entry, comps)``: the entry computation's instructions in scheduled order, each a dict
    (name, op, operands, line), and every computation's lines by name."""
    entry, comps = hlo_stats.computations(text)
    instrs = []
    for line in comps.get(entry, []):
        m = _INSTR.match(line)
        if m:
            instrs.append(
                {
                    "name": m.group(1),
                    "op": m.group(3),
                    "shape": m.group(2),
                    "operands": _operands(m.group(4)),
                    "line": line,
                }
            )
    return instrs, comps


def _has_dot(comp: str, comps: dict, seen: set) -> bool:
    if comp in seen or comp not in comps:
        return False
    seen.add(comp)
    for line in comps[comp]:
        m = _INSTR.match(line)
        if not m:
            continue
        if m.group(3) in ("dot", "convolution") or "gemm" in line or "matmul" in line:
            return True
        called = _CALLS.search(line)
        if called and _has_dot(called.group(1), comps, seen):
            return True
    return False


def classify(ins: dict, comps: dict) -> tuple[bool, bool]:
    """``(compute, gemm)`` of one entry instruction."""
    op, line = ins["op"], ins["line"]
    if op in ("dot", "convolution"):
        return True, True
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', line)
        t = target.group(1).lower() if target else ""
        return True, "gemm" in t or "matmul" in t
    if op == "fusion":
        called = _CALLS.search(line)
        return True, bool(called and _has_dot(called.group(1), comps, set()))
    return False, False


def collective(op: str) -> tuple[str, str] | None:
    """``(kind, "start" | "done" | "sync")`` of a collective opcode, else None."""
    for kind in COLLECTIVES:
        if op == kind:
            return kind, "sync"
        if op == f"{kind}-start":
            return kind, "start"
        if op == f"{kind}-done":
            return kind, "done"
    return None


def leaf_names(specs) -> tuple[list[str], dict[str, int]]:
    """The entry's parameter labels (each argument leaf's path, shortened to ``l7.w``) and
    each label's global element count."""
    out, sizes = [], {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(specs)[0]:
        text = jax.tree_util.keystr(path)
        keys = re.findall(r"\['([^']*)'\]", text)
        out.append(".".join(keys[-2:]) if keys else text)
        sizes[out[-1]] = int(np.prod(np.shape(leaf)))
    return out, sizes


_ARRAY = re.compile(r"\b(?:pred|[a-z]+\d+)\[([\d,]*)\]")


def elements(shape: str) -> list[int]:
    """The element count of every array in an HLO shape (a tuple's too)."""
    return [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in _ARRAY.findall(shape)]


def analyse(compiled, specs) -> dict:
    instrs, comps = parse(compiled.as_text())
    pos = {ins["name"]: i for i, ins in enumerate(instrs)}
    users: dict[str, list[str]] = defaultdict(list)
    for ins in instrs:
        for o in ins["operands"]:
            users[o].append(ins["name"])
    kinds = [classify(ins, comps) for ins in instrs]
    labels, sizes = leaf_names(specs)
    n_params = sum(ins["op"] == "parameter" for ins in instrs)
    if n_params != len(labels):  # unused arguments dropped: no labels
        labels = []

    counts: dict[str, int] = defaultdict(int)
    gathers = []  # (start index, done index)
    for i, ins in enumerate(instrs):
        c = collective(ins["op"])
        if c is None:
            continue
        kind, phase = c
        if phase == "sync":
            counts[f"{kind}-start"] += 1
            counts[f"{kind}-done"] += 1
        else:
            counts[f"{kind}-{phase}"] += 1
        if kind == "all-gather" and phase in ("sync", "start"):
            done = i
            if phase == "start":
                done = min(
                    (
                        pos[u]
                        for u in users[ins["name"]]
                        if instrs[pos[u]]["op"] == "all-gather-done"
                    ),
                    default=i,
                )
            gathers.append((i, done))
    counts["async-start (other)"] = sum(ins["op"] == "async-start" for ins in instrs)

    def params_of(i: int) -> set[str]:
        """The model params (``l7.w``) an instruction's operands come from: for each operand,
        the nearest ones walked back through the entry, not across collectives (a re-gather's
        operand also reaches earlier blocks' params, through the cotangent it is tied to)."""
        found: set[str] = set()
        for operand in instrs[i]["operands"]:
            level, seen = [operand], set()
            while level:
                hits, nxt = set(), []
                for name in level:
                    if name in seen or name not in pos:
                        continue
                    seen.add(name)
                    ins = instrs[pos[name]]
                    if collective(ins["op"]) is not None:
                        continue
                    m = _PARAM.search(ins["line"]) if ins["op"] == "parameter" else None
                    k = int(m.group(1)) if m else -1
                    if 0 <= k < len(labels) and re.match(r"l\d+\.", labels[k]):
                        hits.add(labels[k])
                    nxt.extend(ins["operands"])
                if hits:
                    found |= hits
                    break
                level = nxt
        return found

    def after_gather(i: int) -> bool:
        """Whether instruction ``i`` depends on an all-gather's result."""
        seen, stack = set(), list(instrs[i]["operands"])
        while stack:
            name = stack.pop()
            if name in seen or name not in pos:
                continue
            seen.add(name)
            c = collective(instrs[pos[name]]["op"])
            if c is not None and c[0] == "all-gather":
                return True
            stack.extend(instrs[pos[name]]["operands"])
        return False

    def first_gemm_using(i: int) -> int | None:
        """Scheduled index of the first matrix product that depends on instruction ``i``."""
        seen, stack, best = set(), list(users[instrs[i]["name"]]), None
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            j = pos[name]
            if kinds[j][1]:
                best = j if best is None else min(best, j)
            stack.extend(users[name])
        return best

    # A param all-gather: its operand comes from model params and its result holds whole ones
    # (a gather of activations, GSPMD's, may also reach a param through a local product).
    regathers, earlier, param_gathers = [], set(), 0
    for start, done in gathers:
        got = params_of(start)
        out = elements(instrs[done]["shape"])
        if labels and not (
            got and (sum(out) == sum(sizes[p] for p in got) or set(out) & {sizes[p] for p in got})
        ):
            continue  # without labels (arguments dropped) every all-gather counts
        param_gathers += 1
        # a re-gather gathers params an earlier gather gathered (the forward's gathers may
        # depend on earlier gathers too: each waits for the previous block's inputs)
        if (got and got <= earlier) or (not got and after_gather(start)):
            regathers.append({"start": start, "done": done, "params": sorted(got)})
        earlier |= got
    for k, g in enumerate(regathers):
        window = range(g["start"] + 1, g["done"])
        g["win"] = sum(kinds[j][0] for j in window)
        g["gemm"] = sum(kinds[j][1] for j in window)
        g["ahead"] = None
        if k:
            prev_use = first_gemm_using(regathers[k - 1]["done"])
            g["ahead"] = prev_use is not None and g["start"] < prev_use
    mem = compiled.memory_analysis()
    return {
        "args": mem.argument_size_in_bytes,
        "temp": mem.temp_size_in_bytes,
        "counts": dict(counts),
        "gathers": len(gathers),
        "param gathers": param_gathers,
        "regathers": regathers,
        "ops": len(instrs),
        "compute": sum(c for c, _ in kinds),
        "gemms": sum(g for _, g in kinds),
        "text": compiled.as_text(),
    }


# ------------------------------------------------------------------------------------ output
def report(rows: dict[str, dict]) -> list[str]:
    kinds = [f"{k}-{p}" for k in COLLECTIVES for p in ("start", "done")]
    kinds = [k for k in kinds if any(r["counts"].get(k) for r in rows.values())]
    kinds.append("async-start (other)")
    names = list(rows)
    w = max(len(n) for n in names)
    out = [f"| {'':25s} | " + " | ".join(f"{n:>{w}s}" for n in names) + " |"]
    out.append(f"|{'-' * 27}|" + "|".join("-" * (w + 1) + ":" for _ in names) + "|")

    def line(label: str, values: list) -> None:
        out.append(f"| {label:25s} | " + " | ".join(f"{v!s:>{w}s}" for v in values) + " |")

    line("args MiB/device", [f"{r['args'] / MIB:.2f}" for r in rows.values()])
    line("temp MiB/device", [f"{r['temp'] / MIB:.2f}" for r in rows.values()])
    line("args+temp MiB/device", [f"{(r['args'] + r['temp']) / MIB:.2f}" for r in rows.values()])
    line("entry ops", [r["ops"] for r in rows.values()])
    line("compute ops (gemms)", [f"{r['compute']} ({r['gemms']})" for r in rows.values()])
    for k in kinds:
        line(k, [r["counts"].get(k, 0) for r in rows.values()])
    line("param all-gathers", [r["param gathers"] for r in rows.values()])
    line("backward re-gathers", [len(r["regathers"]) for r in rows.values()])
    line(
        "re-gathers w/ gemm in win",
        [sum(g["gemm"] > 0 for g in r["regathers"]) for r in rows.values()],
    )
    line(
        "compute ops in windows",
        [sum(g["win"] for g in r["regathers"]) for r in rows.values()],
    )
    line(
        "gemms in windows",
        [sum(g["gemm"] for g in r["regathers"]) for r in rows.values()],
    )
    line(
        "re-gathers ahead",
        [
            f"{sum(bool(g['ahead']) for g in r['regathers'])}/{max(len(r['regathers']) - 1, 0)}"
            for r in rows.values()
        ],
    )
    for name, r in rows.items():
        out.append(f"\n{name}: backward re-gathers in scheduled order (entry op index)")
        for g in r["regathers"]:
            ahead = {None: "-", True: "yes", False: "no"}[g["ahead"]]
            out.append(
                f"  {','.join(g['params']) or '?':12s} start {g['start']:4d} done {g['done']:4d}"
                f"  win {g['win']:3d}  gemm {g['gemm']:2d}  ahead {ahead}"
            )
    return out


VARIANTS = ("FSDP prefetch", "FSDP no prefetch", "GSPMD competent", "GSPMD naive")


def build(name: str):
    """``(compiled step, its argument specs)`` of one variant."""
    params = memory.unrolled_params(memory.UNROLLED)
    batch = batch_arrays()
    if name == "FSDP prefetch":
        return fsdp_compiled(params, batch, dp.sync.FSDP())
    if name == "FSDP no prefetch":
        return fsdp_compiled(params, batch, dp.sync.FSDP(prefetch=False))
    return gspmd_compiled(params, batch, name == "GSPMD competent")


def run_one(name: str, t0: float) -> dict | None:
    """Compile and analyse one variant here; None (the traceback printed) if that fails."""
    print(f"[{time.perf_counter() - t0:6.1f} s] compiling {name}", flush=True)
    try:
        compiled, specs = build(name)
        row = analyse(compiled, specs)
    except Exception:
        traceback.print_exc()
        return None
    print(
        f"[{time.perf_counter() - t0:6.1f} s] {name}: args+temp "
        f"{(row['args'] + row['temp']) / MIB:.2f} MiB, {len(row['regathers'])} re-gathers",
        flush=True,
    )
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        path = os.path.join(args.dump, name.replace(" ", "_") + ".hlo.txt")
        with open(path, "w") as f:
            f.write(row["text"])
    return row


def run_isolated(name: str, limit: float, t0: float) -> dict | None:
    """One variant compiled by a child process (this script with ``--only``), stopped after
    ``limit`` seconds; its output is printed (less the donation warnings' long lines)."""
    argv = [sys.executable, sys.argv[0], "--only", name, *sys.argv[1:]]
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            print(f"[{time.perf_counter() - t0:6.1f} s] {name}: stopped after {limit:g} s")
        log.seek(0)
        row = None
        for line in log:
            if line.startswith("ROW "):
                row = json.loads(line[4:])
            elif len(line) < 2000:
                print(line, end="")
    sys.stdout.flush()
    return row


def main() -> int:
    t0 = time.perf_counter()
    limit = args.isolate if args.isolate is not None else (None if args.cpu else 60.0)
    if args.only is not None:  # a child: one variant, its row as JSON
        if not args.cpu:  # where a compile hangs, say so before the parent stops it
            faulthandler.dump_traceback_later(max(limit - 10, 5), repeat=True)
        row = run_one(args.only, t0)
        if row is None:
            return 1
        row.pop("text")
        print("ROW " + json.dumps(row), flush=True)
        return 0
    if limit is None:
        devices = jax.devices()
        if len(devices) != DEVICES:
            print(f"need {DEVICES} devices, got {len(devices)}: {devices}")
            return 1
        d = devices[0]
        where = f"{len(devices)} devices ({getattr(d, 'device_kind', '?')})"
    else:
        where = f"each variant in a process of its own, stopped after {limit:g} s"
    print(
        f"jax {jax.__version__}, {'8 XLA:CPU devices' if args.cpu else MOCK + ', compiled only'}"
        f"; {where}\n"
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}\n"
        f"model: memory.py's unrolled {memory.UNROLLED} layers of {memory.WIDTH}x{memory.WIDTH}, "
        f"Adam, global batch {memory.BATCH}, float32",
        flush=True,
    )
    rows = {}
    for name in VARIANTS:
        row = run_one(name, t0) if limit is None else run_isolated(name, limit, t0)
        if row is not None:
            rows[name] = row
    if rows:
        print("\n".join(report(rows)))
    return 0 if len(rows) == len(VARIANTS) else 1


if __name__ == "__main__":
    sys.exit(main())

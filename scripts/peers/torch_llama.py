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
  batch × N / (time to generate 1 + N tokens − time to generate 1). `--eager`: the same
  without compiling (every operation launched from Python each step: how far launch
  overhead alone holds a decode step back).

Each measurement is the median of several timed runs after a warm-up (CUDA events on a
GPU). Prints a table and writes every number as JSON (`--out`). `--tiny` runs small
shapes on the CPU to check the script itself; its numbers mean nothing.

  python3 scripts/peers/torch_llama.py all --out results/baselines/h200/torch-anchors.json
"""
import argparse
import json
import statistics
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


def sdpa(dev, shapes, lengths):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    h, kvh = shapes["num_attention_heads"], shapes["num_key_value_heads"]
    d = shapes["hidden_size"] // h
    backends = [SDPBackend.FLASH_ATTENTION] if dev.type == "cuda" else [SDPBackend.MATH]
    once = timer(dev)
    rows = []
    for n in lengths:
        g = torch.Generator(device=dev).manual_seed(n)
        q = torch.randn(1, h, n, d, dtype=torch.bfloat16, device=dev, generator=g)
        k = torch.randn(1, kvh, n, d, dtype=torch.bfloat16, device=dev, generator=g)
        v = torch.randn(1, kvh, n, d, dtype=torch.bfloat16, device=dev, generator=g)
        gqa = "native"

        def run():
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        try:
            run()
        except RuntimeError as e:
            # A backend without grouped heads: the same FLOPs over repeated K/V.
            print(f"sdpa {n}: enable_gqa refused ({e}); K/V repeated per group", file=sys.stderr)
            k = k.repeat_interleave(h // kvh, dim=1)
            v = v.repeat_interleave(h // kvh, dim=1)
            gqa = "repeated"

            def run():
                with sdpa_kernel(backends):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        flops = 4 * h * d * n * (n + 1) / 2
        reps = 3 if n >= 65536 else 10
        s = median_of(once, run, reps)
        rows.append({
            "prompt": n, "heads": h, "kv_heads": kvh, "head_dim": d, "gqa": gqa,
            "backend": backends[0].name, "seconds": s, "flops": flops,
            "tflops_per_s": flops / s / 1e12, "reps": reps,
        })
        print(f"sdpa causal {n:>7} tokens: {s * 1e3:9.2f} ms  {flops / s / 1e12:7.1f} TFLOP/s ({gqa} GQA)")
        del q, k, v
    return rows


def decode(dev, shapes, batches, prompt, new, reps, done=lambda rows: None, eager=False):
    from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

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
    compile_config = CompileConfig(mode="reduce-overhead", fullgraph=True)
    # transformers compiles on accelerators only; --tiny checks the compiled path on
    # the CPU too.
    compile_config._compile_all_devices = dev.type != "cuda"
    once = timer(dev)
    rows = []
    for b in batches:
        g = torch.Generator(device=dev).manual_seed(b)
        ids = torch.randint(3, cfg.vocab_size, (b, prompt), device=dev, generator=g)
        mask = torch.ones_like(ids)

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

        # The first runs compile and capture the graphs.
        gen(1 + new)()
        first = median_of(once, gen(1), reps)
        whole = median_of(once, gen(1 + new), reps)
        tok_s = b * new / (whole - first)
        # generate() keeps the compiled forward here once it has used it.
        compiled = hasattr(model, "_compiled_call")
        if compiled == eager:
            sys.exit(f"decode: asked for {'eager' if eager else 'compiled'} decode steps, "
                     f"transformers {'compiled' if compiled else 'did not compile'} them")
        rows.append({
            "compiled": compiled,
            "batch": b, "prompt": prompt, "new_tokens": new, "prefill_and_one_s": first,
            "prefill_and_all_s": whole, "decode_tok_s": tok_s,
            "step_ms": (whole - first) / new * 1e3, "reps": reps,
        })
        print(f"decode batch {b:>3} after {prompt} tokens: {tok_s:9.1f} tok/s, "
              f"{(whole - first) / new * 1e3:7.2f} ms per step (first token {first:.3f} s)")
        done(rows)
    return rows


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
    ap.add_argument("--out", help="write the numbers as JSON here")
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

    # Written after each part and each batch: a run stopped at a time limit keeps what
    # it measured.
    def save():
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)

    lengths = a.lengths or ("256,512" if a.tiny else "4096,16384,32768,65536,131072")
    if a.what in ("sdpa", "all"):
        res["sdpa"] = sdpa(dev, shapes, [int(x) for x in lengths.split(",")])
        save()
    if a.what in ("decode", "all"):
        def done(rows):
            res["decode"] = rows
            save()

        decode(dev, shapes, [int(x) for x in a.batches.split(",")], a.prompt, a.new,
               a.reps, done, eager=a.eager)


if __name__ == "__main__":
    main()

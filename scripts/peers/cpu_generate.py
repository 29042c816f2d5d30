#!/usr/bin/env python3
"""kvbench beside llama.cpp and HF transformers on the CPU, in one run.

The same GGUF (SmolLM2-135M-Instruct, Q4_1), the same prompt file, greedy decoding,
the same thread count, one engine at a time, repeated and interleaved so that drift of
the machine lands on every engine alike. Also measures the machine's memory read
bandwidth with the same threads before each round, so decode can be set against its
bound: an f32 decode step must read every weight once (plus the KV cache), so
tok/s <= bandwidth / bytes; each kvbench f32 batch-1 run is set against its round's.

  python3 scripts/peers/cpu_generate.py --kvbench target/release/kvbench \
      --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --prompt-file datasets/fixtures/prose/pride_and_prejudice_pg42671.txt --prompt-chars 2600 \
      [--f32-gguf models/SmolLM2-135M-Instruct.f32.gguf]

Needs (PyPI): llama-cpp-python (builds llama.cpp from source), torch, transformers,
accelerate (transformers asks for it to load a GGUF) and gguf (transformers reads the
GGUF and dequantizes it to f32). Prints a Markdown table
and writes every measurement as JSON (--out).

Definitions, the same for every engine: TTFT is the time from submitting the prompt(s)
to the first generated token of the last sequence (one prefill for the batch); decode
tok/s is (n - 1) generated tokens per sequence over the time from that first token to
the last, times the batch for the aggregate.
"""

import argparse
import json
import warnings
import os
import platform
import statistics
import subprocess
import sys
import time


def read_prompt(path, chars):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return text[:chars] if chars else text


def bandwidth_gb_s(threads, probe=None):
    """Read bandwidth with `threads` threads. With `probe` (kvbench's
    `read_bandwidth` example: a 1 GiB f32 buffer in huge pages as its weights are,
    best of 7), that; else a sum over a 1 GiB torch tensor (best of 5)."""
    if probe:
        out = subprocess.run([probe, str(threads)], capture_output=True, text=True, check=True)
        return float(out.stdout.strip())
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def peer_versions():
    """The peers' package versions (None where a distribution goes by another name):
    their speed moves from release to release."""
    from importlib.metadata import PackageNotFoundError, version

    def of(p):
        try:
            return version(p)
        except PackageNotFoundError:
            return None

    return {p: of(p) for p in ("llama_cpp_python", "transformers", "torch")}


def run_kvbench(binary, gguf, prompt_file, threads, n, batch, dtype):
    cmd = [
        binary, "--threads", str(threads), "generate",
        "--model", gguf, "--prompt-file", prompt_file,
        "--max-new-tokens", str(n), "--ignore-eos", "--json", "--dtype", dtype,
    ]
    if batch > 1:
        cmd += ["--batch", str(batch)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    j = json.loads(out)
    return {
        "kv_device_bytes": j["kv_device_bytes"],
        "prompt_tokens": j["prompt_tokens"],
        "ttft_s": j["batch_ttft_s"] if batch > 1 else j["ttft_s"],
        "decode_tok_s": j["batch_decode_tok_s"] if batch > 1 else j["decode_tok_s"],
        "weights_bytes": j["weights_bytes"],
        "weights_dtype": j["weights_dtype"],
    }


def gguf_decode_bytes(gguf):
    """(bytes of a GGUF's tensors, bytes of llama.cpp's K/V per token): what an f32
    decode step of llama.cpp reads, its weights once (a tied head is the embedding)
    and its f16 K/V cache (the default)."""
    from gguf import GGUFReader

    r = GGUFReader(gguf)
    arch = r.fields["general.architecture"].contents()
    meta = lambda k: int(r.fields[f"{arch}.{k}"].contents())
    head_dim = meta("embedding_length") // meta("attention.head_count")
    kv_per_token = meta("block_count") * 2 * meta("attention.head_count_kv") * head_dim * 2
    return sum(int(t.n_bytes) for t in r.tensors), kv_per_token


class LlamaCpp:
    def __init__(self, gguf, threads, n_ctx):
        from llama_cpp import Llama

        self.llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads,
                         n_ctx=n_ctx, n_batch=512, verbose=False)

    def run(self, prompt, n):
        import numpy as np

        llm = self.llm
        n_vocab = llm.n_vocab()

        def greedy():
            # Without logits_all only the last position's logits exist, in the context.
            return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=False)
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = greedy()
        t_first = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([tok])
            tok = greedy()
        t_last = time.perf_counter()
        return {
            "prompt_tokens": len(ids),
            "ttft_s": t_first - t0,
            "decode_tok_s": (n - 1) / (t_last - t_first),
        }


class Transformers:
    def __init__(self, gguf, threads):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        d, f = os.path.split(os.path.abspath(gguf))
        self.tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        self.model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        self.model.eval()

    def run(self, prompt, n, batch):
        import torch

        ids = self.tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        ids = ids.repeat(batch, 1)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(ids, use_cache=True)
            nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
            t_first = time.perf_counter()
            past = out.past_key_values
            for _ in range(n - 1):
                out = self.model(nxt, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
            t_last = time.perf_counter()
        return {
            "prompt_tokens": ids.shape[1],
            "ttft_s": t_first - t0,
            "decode_tok_s": batch * (n - 1) / (t_last - t_first),
        }


def main():
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kvbench", required=True, help="the kvbench binary (release build)")
    p.add_argument("--gguf", required=True)
    p.add_argument("--prompt-file", required=True)
    p.add_argument("--prompt-chars", type=int, default=0,
                   help="use the first N characters of the prompt file (0: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="results/peers-cpu.json")
    p.add_argument("--f32-gguf", default=None,
                   help="the same model's weights in f32 (scripts/peers/gguf_to_f32.py): "
                        "llama.cpp also decodes them at batch 1, against the same bound as "
                        "kvbench's f32")
    p.add_argument("--read-bandwidth", default=None,
                   help="kvbench's read bandwidth probe (cargo build --release -p "
                        "kvbench-engines --examples: target/release/examples/read_bandwidth); "
                        "default: a torch sum")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]

    prompt = read_prompt(a.prompt_file, a.prompt_chars)
    # kvbench reads the prompt from a file; give it exactly the text the peers get.
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    prompt_path = os.path.splitext(a.out)[0] + ".prompt.txt"
    with open(prompt_path, "w", encoding="utf-8") as f:
        f.write(prompt)

    versions = peer_versions()
    print("loading llama.cpp and transformers ...", file=sys.stderr)
    lcpp = LlamaCpp(a.gguf, a.threads, n_ctx=4096)
    lcpp32, lcpp32_bytes = None, None
    if a.f32_gguf:
        lcpp32 = LlamaCpp(a.f32_gguf, a.threads, n_ctx=4096)
        lcpp32_bytes = gguf_decode_bytes(a.f32_gguf)
    hf = Transformers(a.gguf, a.threads)
    rows = []
    bws = []
    meta = {
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": a.threads,
        "new_tokens": a.new_tokens,
        "read_bandwidth_gb_s": bws,
        "read_bandwidth_probe": "kvbench read_bandwidth" if a.read_bandwidth else "torch sum",
        "date": time.strftime("%Y-%m-%d"),
        "versions": versions,
    }

    # Written after every run, so that a run that fails keeps those before it.
    def save():
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)

    for rep in range(a.repeats):
        # The probe before each round: this shared machine's memory drifts between
        # rounds, and a round's runs are set against the bandwidth of their round.
        bw = bandwidth_gb_s(a.threads, a.read_bandwidth)
        bws.append(bw)
        print(f"read bandwidth, {a.threads} threads: {bw:.1f} GB/s", file=sys.stderr)
        for b in batches:
            runs = []
            if b == 1:
                runs.append(("llama.cpp (Q4_1)", lambda: lcpp.run(prompt, a.new_tokens)))
                if lcpp32:
                    runs.append(("llama.cpp (f32)", lambda: lcpp32.run(prompt, a.new_tokens)))
            runs.append(("HF transformers (f32)", lambda b=b: hf.run(prompt, a.new_tokens, b)))
            # Q4_1 prefill is slow in candle on this CPU (a 16 x 500-token batch would
            # take minutes): the quantized path is measured at batch 1 only.
            for dtype in ("auto", "quantized") if b == 1 else ("auto",):
                runs.append((f"kvbench --dtype {dtype}",
                             lambda b=b, dtype=dtype: run_kvbench(
                                 a.kvbench, a.gguf, prompt_path, a.threads,
                                 a.new_tokens, b, dtype)))
            for name, f in runs:
                r = f()
                r.update(engine=name, batch=b, repeat=rep, read_bandwidth_gb_s=bw)
                step_bytes = None
                if r.get("weights_dtype") == "f32" and b == 1:
                    # An f32 decode step reads every weight once and the request's KV
                    # (at the end of the run): tok/s <= bandwidth / those bytes.
                    step_bytes = r["weights_bytes"] + r["kv_device_bytes"]
                elif name == "llama.cpp (f32)":
                    weights, kv_per_token = lcpp32_bytes
                    step_bytes = weights + kv_per_token * (r["prompt_tokens"] + a.new_tokens)
                if step_bytes:
                    bound = bw * 1e9 / step_bytes
                    r.update(f32_decode_bound_tok_s=bound, of_bound=r["decode_tok_s"] / bound)
                print(json.dumps(r), file=sys.stderr)
                rows.append(r)
                save()

    print(f"\n{a.threads} threads, {a.new_tokens} generated tokens, {a.repeats} rounds, "
          f"read bandwidth {min(bws):.1f}-{max(bws):.1f} GB/s; medians over the rounds")
    print("\n| engine | batch | prompt tokens | TTFT s | decode tok/s | of the f32 bound |")
    print("|---|---|---|---|---|---|")
    keys = []
    for r in rows:
        if (r["engine"], r["batch"]) not in keys:
            keys.append((r["engine"], r["batch"]))
    for engine, batch in keys:
        rs = [r for r in rows if r["engine"] == engine and r["batch"] == batch]
        ratios = [r["of_bound"] for r in rs if "of_bound" in r]
        share = (f"{100 * statistics.median(ratios):.0f} % "
                 f"({100 * min(ratios):.0f}-{100 * max(ratios):.0f})" if ratios else "")
        print(f"| {engine} | {batch} | {rs[0]['prompt_tokens']} | "
              f"{statistics.median(r['ttft_s'] for r in rs):.2f} | "
              f"{statistics.median(r['decode_tok_s'] for r in rs):.1f} | {share} |")


if __name__ == "__main__":
    main()

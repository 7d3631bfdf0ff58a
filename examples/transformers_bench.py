"""attn_implementation="attnkit" against "sdpa" in a transformers model, on this machine.

    python examples/transformers_bench.py [--repeat 3] [--quick]

A 4-layer Llama (hidden 512, 8 heads, 2 key/value heads, head dim 64, MLP 1408, vocabulary
8192, random weights built from the config) at batch 2 x 2048 tokens: the median time of a
forward and of a forward + backward (cross-entropy on every token), in float32 and bfloat16;
then greedy generation (2 prompts of 256 tokens, 64 new tokens each; then the same with the
second prompt left-padded by 64 tokens) in tokens per second, and one decoding step's attention
call alone (batch 2, 8 query and 2 key/value heads, 257 cached keys, head dim 64: p50 and p90
of 2000 calls, in microseconds). The same model with a Mistral-style sliding window of 512 at
batch 1 x 8192 tokens, with the time of each step spent in the attention calls
(torch.profiler, a record_function around each call). Before timing, each pair is checked to
agree (logits, generated tokens).

Every pair runs interleaved (``--repeat`` rounds, the order alternating) and the speed-up is the
median over rounds of sdpa's time over attnkit's (tokens/s: attnkit's over sdpa's).
Printed: the CPU (lscpu's model name and its SIMD flags), the load average before and after,
torch's thread count, and one table whose last column is the CPU other processes used while
that row was measured (in cores, from /proc: on a shared machine a row with much of it is not
to be trusted). ``--quick`` shrinks every size for a smoke run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from typing import Callable, Dict, List, Tuple

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import (
    AttentionInterface,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")
from attnkit.bench.runner import cpu_sample, others_cpu_cores

IMPLS = ("sdpa", "attnkit")
#: autograd nodes of the attention calls: torch SDPA's (fused or math) and attnkit's
BACKWARD_NODES = ("ScaledDotProduct", "_AttentionFunctionBackward")


def cpu_description() -> str:
    """lscpu's model name and the SIMD flags that matter for these kernels."""
    model, flags = platform.processor() or "unknown CPU", ""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            model = value.strip()
        elif key.strip() == "Flags":
            wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16",
                      "amx_tile")
            flags = " ".join(f for f in value.split() if f in wanted)
    return f"{model} ({os.cpu_count()} CPUs; {flags or 'flags unknown'})"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def paired_s(fns: Dict[str, Callable[[], object]],
             repeat: int) -> Tuple[Dict[str, float], float]:
    """Each implementation's median time over ``repeat`` rounds, the implementations
    interleaved (their order alternating from round to round, so a machine that speeds up or
    slows down meanwhile weighs on both alike), and the median over rounds of the per-round
    speed-up ``time[sdpa] / time[attnkit]``."""
    for fn in fns.values():
        fn()  # warm-up (kernel builds, allocator)
    times: Dict[str, List[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeat):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(times["sdpa"], times["attnkit"])]
    return {n: statistics.median(t) for n, t in times.items()}, statistics.median(ratios)


def build(impl: str, sliding: int | None, dtype: torch.dtype, quick: bool):
    kw = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384,
              attn_implementation=impl, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if quick:
        kw.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    torch.manual_seed(0)
    if sliding is None:
        model = LlamaForCausalLM(LlamaConfig(**kw))
    else:
        model = MistralForCausalLM(MistralConfig(**kw, sliding_window=sliding))
    return model.to(dtype).eval()


def step_fns(model, ids) -> Tuple[Callable[[], object], Callable[[], object]]:
    def forward():
        with torch.no_grad():
            return model(ids, use_cache=False).logits

    def forward_backward():
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out.loss

    return forward, forward_backward


def generation_rates(models, prompts, new: int, repeat: int,
                     mask=None) -> Tuple[Dict[str, float], float, bool]:
    """Greedy generation of ``new`` tokens per prompt (``mask``: the padding mask, all ones by
    default): new tokens per second for each implementation, attnkit's speed-up (median over
    interleaved rounds) and whether they generated the same tokens."""
    tokens = {}
    mask = torch.ones_like(prompts) if mask is None else mask

    def gen(impl: str) -> None:
        with torch.no_grad():
            tokens[impl] = models[impl].generate(
                prompts, attention_mask=mask, max_new_tokens=new,
                min_new_tokens=new, do_sample=False, pad_token_id=0)

    t, speedup = paired_s({impl: (lambda impl=impl: gen(impl)) for impl in IMPLS}, repeat)
    rate = {impl: prompts.shape[0] * new / t[impl] for impl in IMPLS}
    return rate, speedup, torch.equal(tokens["sdpa"], tokens["attnkit"])


def decode_step_us(calls: int = 2000) -> Dict[str, Tuple[float, float]]:
    """One decoding step's attention call, as the 4-layer Llama makes it (batch 2, 8 query and
    2 key/value heads, 257 cached keys, head dim 64, float32, no grad): (p50, p90) of
    ``calls`` calls in microseconds, ``time.perf_counter_ns``, the implementations
    interleaved in rounds of 200."""
    import attnkit

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 64, generator=g)
    k, v = torch.randn(2, 2, 257, 64, generator=g), torch.randn(2, 2, 257, 64, generator=g)
    fns = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
               q, k, v, is_causal=False, enable_gqa=True),
           "attnkit": lambda: attnkit.attention(q, k, v, causal=True, diagonal="bottom_right")}
    times: Dict[str, List[int]] = {name: [] for name in fns}
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(200):
                fn()
        for _ in range(max(1, calls // 200)):
            for name, fn in fns.items():
                for _ in range(200):
                    t0 = time.perf_counter_ns()
                    fn()
                    times[name].append(time.perf_counter_ns() - t0)
    out = {}
    for name, ts in times.items():
        ts.sort()
        out[name] = (ts[len(ts) // 2] / 1e3, ts[int(len(ts) * 0.9)] / 1e3)
    return out


def attention_share(model, fn: Callable[[], object], impl: str) -> float:
    """Fraction of ``fn``'s CPU time inside the model's attention calls: the forward calls
    (a ``record_function`` around each) and, for a backward, the attention's autograd nodes."""
    original = AttentionInterface._global_mapping[impl]

    def timed(*args, **kwargs):
        with record_function("attention_call"):
            return original(*args, **kwargs)

    AttentionInterface._global_mapping[impl] = timed
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("step"):
                fn()
    finally:
        AttentionInterface._global_mapping[impl] = original
    step = attention = 0.0
    for ev in prof.key_averages():
        if ev.key == "step":
            step = ev.cpu_time_total
        elif ev.key == "attention_call" or (  # the forward calls, then their backward nodes
                ev.key.startswith("autograd::engine::evaluate_function:")
                and any(name in ev.key for name in BACKWARD_NODES)):
            attention += ev.cpu_time_total
    return attention / max(step, 1e-9)


class Rows(list):
    """Table rows, each ending with the cores' worth of CPU that other processes used since
    the previous row (``n/a`` without /proc)."""

    def __init__(self) -> None:
        super().__init__()
        self.mark = cpu_sample()

    def add(self, *cells: str) -> None:
        others = others_cpu_cores(self.mark, cpu_sample())
        self.append((*cells, "n/a" if others is None else f"{others:.2f}"))
        self.mark = cpu_sample()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = ap.parse_args()
    q = args.quick
    batch, seq = (2, 256) if q else (2, 2048)
    prompt, new = (32, 8) if q else (256, 64)
    long_seq, window = (1024, 128) if q else (8192, 512)

    print(f"CPU: {cpu_description()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average before: "
          f"{load_average()}")
    rows = Rows()
    g = torch.Generator().manual_seed(0)

    for dtype in (torch.float32, torch.bfloat16):
        dname = str(dtype).replace("torch.", "")
        ids = torch.randint(3, 8192, (batch, seq), generator=g)
        models = {impl: build(impl, None, dtype, q) for impl in IMPLS}
        with torch.no_grad():
            a, b = (models[i](ids[:, :256], use_cache=False).logits.float() for i in IMPLS)
        print(f"llama {dname}: max |attnkit - sdpa| logits {(a - b).abs().max().item():.2e}")
        for what, idx in (("forward", 0), ("forward+backward", 1)):
            t, speedup = paired_s({i: step_fns(models[i], ids)[idx] for i in IMPLS},
                                  args.repeat)
            rows.add(f"llama {batch}x{seq}", dname, what, f"{t['sdpa'] * 1e3:.0f} ms",
                     f"{t['attnkit'] * 1e3:.0f} ms", f"{speedup:.2f}x")
        if dtype == torch.float32:
            prompts = torch.randint(3, 8192, (2, prompt), generator=g)
            rate, speedup, same = generation_rates(models, prompts, new, args.repeat)
            rows.add(f"generate 2x{prompt}+{new}", dname, "tokens/s",
                     f"{rate['sdpa']:.1f}", f"{rate['attnkit']:.1f}",
                     f"{speedup:.2f}x" + ("" if same else " (!)"))
            print(f"generate: same tokens for sdpa and attnkit: {same}")
            pad = prompt // 4
            mask = torch.ones_like(prompts)
            mask[1, :pad] = 0  # the second prompt left-padded
            padded = prompts.masked_fill(mask == 0, 0)
            rate, speedup, same = generation_rates(models, padded, new, args.repeat, mask)
            rows.add(f"generate 2x{prompt}+{new}, {pad} left pad", dname, "tokens/s",
                     f"{rate['sdpa']:.1f}", f"{rate['attnkit']:.1f}",
                     f"{speedup:.2f}x" + ("" if same else " (!)"))
            print(f"generate, left padded: same tokens for sdpa and attnkit: {same}")
            us = decode_step_us(400 if q else 2000)
            rows.add("decode step 2x8/2 heads, 257 keys", dname, "us p50 / p90",
                     f"{us['sdpa'][0]:.0f} / {us['sdpa'][1]:.0f}",
                     f"{us['attnkit'][0]:.0f} / {us['attnkit'][1]:.0f}",
                     f"{us['sdpa'][0] / us['attnkit'][0]:.2f}x")
        del models

    for dtype in (torch.float32, torch.bfloat16):
        dname = str(dtype).replace("torch.", "")
        ids = torch.randint(3, 8192, (1, long_seq), generator=g)
        models = {impl: build(impl, window, dtype, q) for impl in IMPLS}
        with torch.no_grad():
            a, b = (models[i](ids[:, :2048], use_cache=False).logits.float() for i in IMPLS)
        print(f"mistral {dname}: max |attnkit - sdpa| logits {(a - b).abs().max().item():.2e}")
        for what, idx in (("forward", 0), ("forward+backward", 1)):
            fns = {impl: step_fns(models[impl], ids)[idx] for impl in IMPLS}
            t, speedup = paired_s(fns, max(1, args.repeat - 1))
            share = {impl: attention_share(models[impl], fns[impl], impl) for impl in IMPLS}
            attn = {i: t[i] * share[i] for i in IMPLS}  # seconds in the attention calls
            rows.add(f"mistral sw{window} 1x{long_seq}", dname, what,
                     f"{t['sdpa'] * 1e3:.0f} ms (attn {attn['sdpa'] * 1e3:.0f} ms)",
                     f"{t['attnkit'] * 1e3:.0f} ms (attn {attn['attnkit'] * 1e3:.0f} ms)",
                     f"{speedup:.2f}x (attn "
                     f"{attn['sdpa'] / max(attn['attnkit'], 1e-9):.2f}x)")
        del models

    print(f"load average after: {load_average()}")
    head = ("model", "dtype", "step", "sdpa", "attnkit", "attnkit speed-up", "others' CPU")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


if __name__ == "__main__":
    main()

"""A small continuous-batching server loop on attnkit: one packed ``varlen_attention`` call per
layer per step over one paged KV cache per layer.

Requests of different prompt lengths arrive over time; a scheduler admits them while the cache
has pages for them, runs their prompts in chunks (chunked prefill) and their generated tokens
one at a time (decoding), all requests of a step packed into one call, and frees a request's
pages when it has its tokens. The model is a tiny Llama built from a transformers config with
random weights (nothing is downloaded); its layers' weights are used directly, with attnkit's
attention over the pages.

    python examples/continuous_batching.py            # tokens/s against transformers' generate
    python examples/continuous_batching.py --check    # greedy tokens equal generate's, per prompt
    python examples/continuous_batching.py --transformers-batching   # and generate_batch's

``--transformers-batching`` also times transformers' own continuous batching
(``generate_batch``, which runs on CPU with its paged cache and "sdpa") on the same requests,
and checks its tokens equal the server's.

``--check`` exits non-zero when any request's tokens differ from what ``generate`` gives for its
prompt alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

import attnkit

SIZES = {  # hidden, layers, heads, kv heads, vocab, intermediate
    "tiny": (64, 2, 4, 2, 256, 128),
    "small": (256, 4, 8, 2, 1024, 512),
}


def tiny_llama(size: str, seed: int = 0):
    """A Llama with random weights (float32, eval mode) from a transformers config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, vocab, inter = SIZES[size]
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=vocab, intermediate_size=inter,
                         max_position_embeddings=4096, attn_implementation="sdpa",
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # every request runs its max_new tokens
    return model


@dataclass
class Request:
    """One request: its prompt, how many tokens to generate, and the step it arrives at."""

    rid: int
    prompt: List[int]
    max_new: int
    arrival: int
    done: int = 0  # prompt tokens already in the cache
    generated: List[int] = field(default_factory=list)

    @property
    def cached(self) -> int:
        """Tokens in the cache: the prompt's processed part and every generated token but the
        last (which is fed in the next step)."""
        return self.done + max(len(self.generated) - 1, 0)

    @property
    def finished(self) -> bool:
        return len(self.generated) >= self.max_new


class Server:
    """The scheduler and the model's forward over paged caches (one per layer)."""

    def __init__(self, model, num_pages: int = 256, page_size: int = 16, chunk: int = 64,
                 max_running: int = 8):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.model, self.apply_rope = model, apply_rotary_pos_emb
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.page_size, self.chunk, self.max_running = page_size, chunk, max_running
        self.caches = [attnkit.PagedKVCache(num_pages, page_size, self.kv_heads, self.head_dim,
                                            dtype=torch.float32)
                       for _ in range(cfg.num_hidden_layers)]
        self.waiting: List[Request] = []
        self.running: List[Request] = []
        self.finished: Dict[int, Request] = {}
        self.steps = 0

    def _pages_for(self, r: Request) -> int:
        return -(-(len(r.prompt) + r.max_new) // self.page_size)

    def admit(self) -> None:
        """Admit arrived requests, oldest first, while there are pages for all their tokens."""
        free = self.caches[0].num_free_pages - sum(
            self._pages_for(r) - len(self.caches[0].pages_of(r.rid)) for r in self.running)
        while (self.waiting and self.waiting[0].arrival <= self.steps
               and len(self.running) < self.max_running
               and self._pages_for(self.waiting[0]) <= free):
            r = self.waiting.pop(0)
            free -= self._pages_for(r)
            for cache in self.caches:
                cache.allocate(r.rid)
            self.running.append(r)

    @torch.no_grad()
    def step(self) -> None:
        """One step: every running request's next tokens (a prompt chunk or its last
        generated token) through the model in one packed call per layer."""
        self.admit()
        self.steps += 1
        if not self.running:
            return
        tokens, positions, counts = [], [], []
        for r in self.running:
            if r.done < len(r.prompt):
                part = r.prompt[r.done:r.done + self.chunk]
                positions += range(r.done, r.done + len(part))
            else:
                part = [r.generated[-1]]
                positions.append(r.cached)
            tokens += part
            counts.append(len(part))
        logits = self._forward(torch.tensor(tokens), torch.tensor(positions), counts)
        for r, n, row in zip(self.running, counts, logits):
            if r.done < len(r.prompt):
                r.done += n
                if r.done < len(r.prompt):
                    continue  # the prompt goes on in the next step
            r.generated.append(int(row.argmax()))
        for r in [r for r in self.running if r.finished]:
            self.running.remove(r)
            for cache in self.caches:
                cache.free(r.rid)
            self.finished[r.rid] = r

    def _forward(self, tokens, positions, counts) -> torch.Tensor:
        """The logits of each request's last token this step, ``(requests, vocab)``."""
        m = self.model.model
        ids = [r.rid for r in self.running]
        cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
        t = tokens.shape[0]
        h = m.embed_tokens(tokens)[None]  # (1, T, hidden)
        cos, sin = m.rotary_emb(h, positions[None])
        for layer, cache in zip(m.layers, self.caches):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, t, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(1, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(1, t, self.kv_heads, self.head_dim)
            q, k = self.apply_rope(q, k, cos, sin)
            q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)  # (T, H, D)
            for rid, a, b in zip(ids, cu[:-1].tolist(), cu[1:].tolist()):
                cache.append(rid, k[a:b], v[0, a:b])
            table, lens = cache.block_table(ids)
            o = attnkit.varlen_attention(q.contiguous(), cache.k_pages, cache.v_pages, cu, None,
                                         seqused_kv=lens, block_table=table,
                                         scale=attn.scaling)
            h = h + attn.o_proj(o.reshape(1, t, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        last = (cu[1:] - 1).tolist()
        return self.model.lm_head(m.norm(h[0, last]))

    def run(self, requests: List[Request]) -> Dict[int, Request]:
        self.waiting = sorted(requests, key=lambda r: (r.arrival, r.rid))
        while self.waiting or self.running:
            self.step()
        return self.finished


def make_requests(n: int, vocab: int, prompt_lengths: List[int], max_new: int,
                  seed: int = 1) -> List[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(i, torch.randint(0, vocab, (prompt_lengths[i % len(prompt_lengths)],),
                                     generator=g).tolist(), max_new, arrival=2 * i)
            for i in range(n)]


@torch.no_grad()
def generate_alone(model, r: Request) -> List[int]:
    out = model.generate(torch.tensor([r.prompt]), max_new_tokens=r.max_new, do_sample=False)
    return out[0, len(r.prompt):].tolist()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="verify every request's greedy tokens against generate() alone")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompts", default="5,70,17,130,1,40",
                    help="prompt lengths, comma separated (cycled over the requests)")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens a step)")
    ap.add_argument("--transformers-batching", action="store_true",
                    help="also time transformers' continuous batching (generate_batch)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    model = tiny_llama(args.size)
    lengths = [int(x) for x in args.prompts.split(",")]
    requests = make_requests(args.requests, model.config.vocab_size, lengths, args.new_tokens)
    if not args.check:  # warm up both sides (kernel builds, first-call costs), untimed
        Server(model, chunk=args.chunk).run([Request(0, requests[0].prompt, 2, 0)])
        generate_alone(model, Request(0, requests[0].prompt, 2, 0))
    server = Server(model, chunk=args.chunk)
    t0 = time.perf_counter()
    done = server.run([Request(r.rid, r.prompt, r.max_new, r.arrival) for r in requests])
    ours = time.perf_counter() - t0
    total = sum(len(r.generated) for r in done.values())
    if args.check:
        bad = 0
        for r in requests:
            want, got = generate_alone(model, r), done[r.rid].generated
            if want != got:
                bad += 1
                print(f"request {r.rid} (prompt {len(r.prompt)}): {got} != generate's {want}")
        print(f"{len(requests) - bad} of {len(requests)} requests give generate()'s tokens "
              f"({server.steps} steps, chunk {args.chunk})")
        return 1 if bad else 0
    t0 = time.perf_counter()
    for r in requests:
        generate_alone(model, r)
    theirs = time.perf_counter() - t0
    print(f"{total} tokens for {len(requests)} requests in {server.steps} steps: attnkit server "
          f"{total / ours:.1f} tokens/s ({ours:.2f} s), transformers generate one by one "
          f"{total / theirs:.1f} tokens/s ({theirs:.2f} s)")
    if args.transformers_batching:
        return batching_comparison(model, requests, done, total)
    return 0


def batching_comparison(model, requests: List[Request], done: Dict[int, Request],
                        total: int) -> int:
    """transformers' continuous batching on the same requests (all submitted at once, a cache
    of 64 pages of 16 tokens): its tokens/s, and whether its tokens equal the server's."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(r.max_new for r in requests), do_sample=False,
                              eos_token_id=None, pad_token_id=0, num_blocks=64, block_size=16,
                              max_batch_tokens=256)
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=[r.prompt for r in requests], generation_config=config,
                               progress_bar=False)
    theirs = time.perf_counter() - t0
    got = [out[f"req_{i}"].generated_tokens for i in range(len(requests))]
    same = all(g[:r.max_new] == done[r.rid].generated for g, r in zip(got, requests))
    print(f"transformers generate_batch (continuous batching): {total / theirs:.1f} tokens/s "
          f"({theirs:.2f} s); its tokens {'equal' if same else 'DIFFER from'} the server's")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

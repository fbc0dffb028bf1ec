#!/usr/bin/env python3
"""Float codec benchmark on real trained tensors (`make bench-codec`).

Trains a small GPT-style transformer with torch on the CPU for a few hundred
steps (byte-level, on Python's own standard library sources as text), then
dumps five data sets, each the concatenation of one dtype's tensors as a
checkpoint shard would hold them:

  bf16 weights            the trained weights cast to bfloat16
  fp32 weights            the trained fp32 master weights
  fp32 upcast from bf16   the bf16 weights cast back to fp32 (low halves zero)
  adam exp_avg            AdamW first moments (fp32)
  adam exp_avg_sq         AdamW second moments (fp32)

It measures the `zipnn` package on the same bytes (one thread), writes
index.json, and runs `go run ./test/bench/floatcodec -dir DIR`, which
measures ckptd's codecs and prints the table.

Why not synthetic Gaussians: trained weights and optimizer moments have
exponent histograms (and zero patterns) that random data does not, and
those decide what an exponent coder wins.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

try:
    import zipnn
except ImportError:  # reported in the table instead
    zipnn = None

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
VOCAB = 256  # bytes


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to a (batch, time, d) tensor."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT-2-shaped language model."""

    def __init__(self, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)
        # GPT-2 initialization: normal(0, 0.02), zero biases. PyTorch's
        # default (uniform) would give exponent statistics no real
        # checkpoint has.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Return next-byte logits for a (batch, time) tensor of bytes."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def corpus(limit: int) -> torch.Tensor:
    """Return Python's standard library sources: real text that ships with Python."""
    out = bytearray()
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as f:
            out += f.read()
        if len(out) >= limit:
            break
    return torch.frombuffer(out[:limit], dtype=torch.uint8).long()


def train(args: argparse.Namespace) -> tuple[GPT, torch.optim.Optimizer, int]:
    """Train for args.steps steps or args.time_budget seconds, whichever ends first."""
    torch.manual_seed(args.seed)
    data = corpus(8 << 20)
    model = GPT(args.d_model, args.layers, args.heads, args.ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    start, step, loss = time.time(), 0, torch.tensor(float("nan"))
    while step < args.steps and time.time() - start < args.time_budget:
        ix = torch.randint(len(data) - args.ctx - 1, (args.batch,))
        x = torch.stack([data[i : i + args.ctx] for i in ix])
        y = torch.stack([data[i + 1 : i + args.ctx + 1] for i in ix])
        loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
    params = sum(p.numel() for p in model.parameters())
    print(
        f"trained a {params / 1e6:.1f}M-parameter transformer for {step} steps "
        f"in {time.time() - start:.0f}s, loss {loss.item():.2f}",
        flush=True,
    )
    return model, opt, step


def raw_bytes(t: torch.Tensor) -> bytes:
    """Return a tensor's bytes as a checkpoint stores them (little-endian)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)  # numpy has no bfloat16
    return t.numpy().tobytes()


def datasets(model: GPT, opt: torch.optim.Optimizer) -> list[tuple[str, str, list[torch.Tensor]]]:
    """Return (name, dtype, tensors) for each data set the table reports."""
    params = list(model.parameters())
    state = [opt.state[p] for p in params]
    bf16 = [p.to(torch.bfloat16) for p in params]
    return [
        ("bf16 weights", "BF16", bf16),
        ("fp32 weights", "F32", params),
        ("fp32 upcast from bf16", "F32", [p.float() for p in bf16]),
        ("adam exp_avg", "F32", [s["exp_avg"] for s in state]),
        ("adam exp_avg_sq", "F32", [s["exp_avg_sq"] for s in state]),
    ]


def measure_zipnn(data: bytes, dtype: str, runs: int) -> dict:
    """Compress and decompress data with zipnn on one thread; best of runs."""
    if zipnn is None:
        return {"error": "zipnn not installed"}
    kind = {"BF16": "bfloat16", "F32": "float32"}[dtype]
    z = zipnn.ZipNN(input_format="byte", bytearray_dtype=kind, threads=1)
    best_c = best_d = float("inf")
    for _ in range(runs):
        # zipnn 0.5.4 reorders its input buffer in place (even a bytes
        # object): give it a fresh copy each time, outside the timing.
        work = bytes(bytearray(data))
        t = time.perf_counter()
        comp = z.compress(work)
        best_c = min(best_c, time.perf_counter() - t)
        t = time.perf_counter()
        back = z.decompress(comp)
        best_d = min(best_d, time.perf_counter() - t)
    if bytes(back) != data:
        return {"error": "zipnn round trip differs"}
    return {"stored": len(comp), "compress_s": best_c, "decompress_s": best_d}


def dump(out: str, model: GPT, opt: torch.optim.Optimizer, steps: int, runs: int) -> None:
    """Write each data set and index.json (with zipnn's figures) into out."""
    index = {"steps": steps, "sets": []}
    for i, (name, dtype, tensors) in enumerate(datasets(model, opt)):
        data = b"".join(raw_bytes(t) for t in tensors)
        file = f"set{i}.bin"
        with open(os.path.join(out, file), "wb") as f:
            f.write(data)
        index["sets"].append(
            {
                "name": name,
                "dtype": dtype,
                "file": file,
                "bytes": len(data),
                "zipnn": measure_zipnn(data, dtype, runs),
            }
        )
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f, indent=1)


def main() -> None:
    """Train, dump, measure zipnn, then hand over to the Go measurement."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--time-budget", type=float, default=90, help="seconds of training at most")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=3, help="timing passes; the best is reported")
    ap.add_argument("--dir", help="keep the tensors here (default: a temporary folder)")
    args = ap.parse_args()

    model, opt, steps = train(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.dir or tmp
        os.makedirs(out, exist_ok=True)
        dump(out, model, opt, steps, args.runs)
        go = os.environ.get("GO", "go")
        cmd = [go, "run", "./test/bench/floatcodec", "-dir", out, "-runs", str(args.runs)]
        sys.exit(subprocess.call(cmd, cwd=REPO))


if __name__ == "__main__":
    main()

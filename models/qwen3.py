"""Qwen3 text encoder for FLUX.2 [klein]: the decoder layers up to the deepest one read, nothing more.

FLUX.2-klein conditions on the hidden states after layers 9, 18 and 27 (transformers' numbering,
where hidden state 0 is the embedding output) of Qwen3-4B (klein-4B) or Qwen3-8B (klein-9B),
concatenated per token: (B, 512, 3 * hidden). No final norm is applied and no layer past the
deepest one read is built, so a 36-layer checkpoint costs 27 layers of memory.

Prompts are wrapped in Qwen3's chat template with thinking turned off, tokenised without BOS/EOS,
truncated to 512 tokens and right-padded with <|endoftext|> (151643). Attention is causal and pad
keys are masked out; pad queries keep their positions (0..511) and their outputs are conditioning
too, so the mask matters at every one of the 512 positions.
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from .common import RMSNorm, load_weights
from .headers import CheckpointError, TensorInfo
from .qwen3_config import QWEN3_8B as QWEN3_8B
from .qwen3_config import Qwen3Config as Qwen3Config
from .qwen3_config import config_from_checkpoint as config_from_checkpoint
from .qwen3_config import parameter_shapes as parameter_shapes
from .qwen3_config import sources as sources
from .streaming import Kept

log = logging.getLogger(__name__)

TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
# special tokens of the template that must come out as single ids
SPECIAL_IDS = {"<|im_start|>": 151644, "<|im_end|>": 151645, "<think>": 151667, "</think>": 151668}
BUNDLED_TOKENIZER = Path(__file__).parent / "data" / "qwen3_tokenizer.json.gz"

def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Qwen3Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k before rotate-half RoPE."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.head_dim = hd
        self.n_rep = cfg.num_heads // cfg.num_kv_heads
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        shape = (b, n, -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.n_rep > 1:
            # explicit repeat: with a mask, enable_gqa would send CUDA to the math kernel
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3Layer(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Embedding(nn.Embedding):
    """nn.Embedding that draws no random init on the meta device: there `normal_` goes through torch's
    reference ops and imports its compiler on first use, 1.5 s here and 4 s on the H200 host, paid by the
    first model load of every process."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Qwen3Encoder(nn.Module):
    """Embedding plus decoder layers 0..n_built-1; returns the chosen hidden states side by side."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3Layer(cfg) for _ in range(cfg.n_built))

    def rope(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (n, head_dim) for positions 0..n-1: computed in fp32, then cast to the working dtype."""
        hd = self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        freqs = torch.arange(n, device=device).float()[:, None] * inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    host_only = ("embed_tokens",)  # streamed (models/streaming.py): the table is looked up on the host

    def streamed_blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                between: Callable[[], None] | None = None) -> torch.Tensor:
        """input_ids (B, L) long, attention_mask (B, L) of 0/1 -> (B, L, len(output_layers) * hidden); `between`
        is called after every layer (a running node's interrupt check)."""
        return self._layers(self.embed_tokens(input_ids), attention_mask, between)

    def _layers(self, x: torch.Tensor, attention_mask: torch.Tensor,
                between: Callable[[], None] | None) -> torch.Tensor:
        n = x.shape[1]
        cos, sin = self.rope(n, x.device, x.dtype)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        mask = causal[None, None] & attention_mask.to(device=x.device, dtype=torch.bool)[:, None, None, :]
        wanted = set(self.cfg.output_layers)
        outs: dict[int, torch.Tensor] = {0: x} if 0 in wanted else {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask)
            if i + 1 in wanted:
                outs[i + 1] = x
            if between is not None:
                between()
        return torch.cat([outs[k] for k in self.cfg.output_layers], dim=-1)

    def forward_streamed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, device: torch.device,
                         between: Callable[[], None] | None = None, resident: Collection[int] = (),
                         kept: Kept | None = None) -> torch.Tensor:
        """`forward` with the weights left in (pinned) host memory: the embedding lookup runs on the host, the
        `resident` layers are copied to `device` once (or found in `kept`, and left there) and every other layer is
        streamed there while the layer before it computes (models/streaming.py). Same operations on the same device,
        so the same numbers."""
        from .streaming import stream_blocks

        x = self.embed_tokens(input_ids.to(self.embed_tokens.weight.device)).to(device)
        with stream_blocks(self, device, resident, kept):
            return self._layers(x, attention_mask, between)


def load_qwen3(infos: Mapping[str, TensorInfo], cfg: Qwen3Config | None = None, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu") -> Qwen3Encoder:
    """Build the encoder from checkpoint headers and read its weights (only the layers it needs). fp8 layers
    (fp8mixed files) stay fp8 and always dequantize, as ComfyUI runs text encoders."""
    cfg = cfg or config_from_checkpoint(infos)
    enc = load_weights(lambda: Qwen3Encoder(cfg), sources(cfg, infos.keys()), infos, dtype=dtype, device=device,
                       fp8_compute="dequant")
    return cast(Qwen3Encoder, enc)


class PromptTokenizer:
    """Qwen3's tokenizer.json through `tokenizers`, giving the ids FLUX.2-klein's pipeline gives."""

    def __init__(self, tokenizer: object, max_length: int = 512, pad_id: int = 151643, origin: str = "") -> None:
        from tokenizers import Tokenizer

        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"expected a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        tokenizer.no_truncation()
        tokenizer.no_padding()
        got = tokenizer.encode("".join(SPECIAL_IDS), add_special_tokens=False).ids
        if got != list(SPECIAL_IDS.values()):
            raise CheckpointError(f"{origin or 'tokenizer'}: not Qwen3's tokenizer (the chat-template tokens "
                                  f"{list(SPECIAL_IDS)} give ids {got[:8]}, expected {list(SPECIAL_IDS.values())})")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.pad_id = pad_id
        self.origin = origin

    @classmethod
    def from_file(cls, path: str | Path, max_length: int = 512, pad_id: int = 151643) -> PromptTokenizer:
        """Load a tokenizer.json (or a gzipped one, *.gz)."""
        from tokenizers import Tokenizer

        path = Path(path)
        try:
            if path.suffix == ".gz":
                with gzip.open(path, "rt", encoding="utf-8") as f:
                    tok = Tokenizer.from_str(f.read())
            else:
                tok = Tokenizer.from_file(str(path))
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read tokenizer ({e})") from e
        except Exception as e:  # tokenizers raises plain Exception on malformed JSON
            raise CheckpointError(f"{path}: not a tokenizer.json ({e})") from e
        return cls(tok, max_length, pad_id, origin=str(path))

    @classmethod
    def bundled(cls, max_length: int = 512, pad_id: int = 151643) -> PromptTokenizer:
        """The Qwen3 tokenizer shipped with this package (models/data/qwen3_tokenizer.json.gz)."""
        return cls.from_file(BUNDLED_TOKENIZER, max_length, pad_id)

    @classmethod
    def find(cls, near: Path | None = None, max_length: int = 512, pad_id: int = 151643) -> PromptTokenizer:
        """A tokenizer.json beside a model (its folder, a tokenizer/ sibling, the parent's tokenizer/), else bundled.

        `near` is a model file or folder, e.g. FLUX.2-klein-4B/, its text_encoder/ or one of its shards.
        A file there that is not Qwen3's tokenizer is skipped with a warning.
        """
        if near is not None:
            near = Path(near)
            folder = near if near.is_dir() else near.parent
            for cand in (folder / "tokenizer.json", folder / "tokenizer" / "tokenizer.json",
                         folder.parent / "tokenizer" / "tokenizer.json"):
                if cand.is_file():
                    try:
                        return cls.from_file(cand, max_length, pad_id)
                    except CheckpointError as e:
                        log.warning("skipping %s: %s", cand, e)
        return cls.bundled(max_length, pad_id)

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids (B, max_length) long, right-padded with pad_id, and the mask (B, max_length): 1 on real tokens."""
        if isinstance(prompts, str):
            prompts = [prompts]
        encs = self.tokenizer.encode_batch([TEMPLATE.format(prompt=p) for p in prompts], add_special_tokens=False)
        ids = torch.full((len(prompts), self.max_length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), self.max_length), dtype=torch.long)
        for row, enc in enumerate(encs):
            toks = enc.ids[: self.max_length]
            ids[row, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            mask[row, : len(toks)] = 1
        return ids, mask


@torch.inference_mode()
def encode_prompts_streamed(encoder: Qwen3Encoder, tokenizer: PromptTokenizer, prompts: list[str],
                            device: torch.device, between: Callable[[], None] | None = None,
                            resident: Collection[int] = (), kept: Kept | None = None) -> torch.Tensor:
    """`encode_prompts` with the encoder's weights in host memory, streamed to `device` layer by layer (the
    `resident` layers copied once)."""
    ids, mask = tokenizer.encode(prompts)
    return encoder.forward_streamed(ids, mask, torch.device(device), between, resident, kept)


@torch.inference_mode()
def encode_prompts(encoder: Qwen3Encoder, tokenizer: PromptTokenizer, prompts: list[str],
                   between: Callable[[], None] | None = None) -> torch.Tensor:
    """Prompts -> FLUX.2-klein conditioning (B, max_length, len(output_layers) * hidden) on the encoder's device."""
    ids, mask = tokenizer.encode(prompts)
    device = encoder.embed_tokens.weight.device
    return encoder(ids.to(device), mask.to(device), between)

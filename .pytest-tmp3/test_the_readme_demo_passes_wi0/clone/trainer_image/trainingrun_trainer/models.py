"""Models that ship with the trainer, and the contract every model (shipped or user's) follows.

Why these two: a tiny character-level transformer and a tiny masked autoencoder are enough to
exercise everything the trainer does (DDP, FSDP2, activation checkpointing, mixed precision,
checkpoint and exact resume) on a laptop CPU in seconds, with data generated in-process
(`trainingrun_trainer.data`), so a new user sees a run learn before spending a cluster.

The model contract
------------------
A model named by `spec.trainer.model.classPath` is an `nn.Module` with:

- `forward(batch: dict[str, Tensor]) -> Tensor`: the scalar mean loss of the batch. The trainer
  owns the loop, so the model owns the loss: the trainer only calls `loss = model(batch)`,
  `loss.backward()`. The batch is whatever the dataset's items collate to (`default_collate` of
  dicts of tensors). Call through `forward` only (not a helper method): under FSDP2 the
  parameters are gathered by forward hooks.
- `blocks: nn.ModuleList`: the repeated layers. The trainer applies activation checkpointing and
  FSDP2 `fully_shard` to each element, and may replace an element in place with a wrapper that
  passes the block's arguments on, so `forward` must reach the blocks through `self.blocks[i]`
  (iterating the list is fine).
- `tokens_per_sample() -> int`: what one sample counts for throughput (tokens/s): predicted
  tokens for text, patches for images.
- `flops_per_sample() -> int`: approximate forward+backward FLOPs of one sample, for MFU. The
  6 x parameters x tokens rule (2 for the forward matmuls, 4 for the backward), plus the attention
  score and value matmuls, which the parameter count misses.

Randomness comes only from the global torch RNG (initialisation, dropout, MAE masking), on the
input's device, so a run is reproducible from its seed and the trainer's saved RNG states make a
resumed run continue exactly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainingrun_api import builtin_args

__all__ = ["CharTransformer", "HuggingFaceCausalLM", "MaskedAutoencoder", "TransformerBlock"]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _checked_tokens(batch: dict[str, Tensor], context_length: int) -> Tensor:
    """The batch's `tokens`, [batch, T + 1] with T <= `context_length`: position t predicts t + 1."""
    tokens = batch["tokens"]
    _require(
        tokens.dim() == 2 and 2 <= tokens.size(1) <= context_length + 1,
        f"tokens must be [batch, length] with 2 <= length <= context_length + 1 = "
        f"{context_length + 1}, got shape {tuple(tokens.shape)}",
    )
    return tokens


def _init_weights(module: nn.Module) -> None:
    """GPT-2 style init: small normal weights, zero biases; uses the global torch RNG."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _matmul_weights(module: nn.Module) -> int:
    """The weights of `module`'s matmuls (its Linear layers'): the N of the 6N rule. Embedding lookups, norms and bias
    additions do no matmul, so their parameters are left out."""
    return sum(layer.weight.numel() for layer in module.modules() if isinstance(layer, nn.Linear))


def _attention_flops(layers: int, dim: int, tokens: int) -> int:
    """Forward+backward FLOPs of QK^T and attention x V over one sequence (not parameters).

    Counted for the full square, as the PaLM/nanoGPT MFU formula does, even when causal.
    """
    return 12 * layers * dim * tokens * tokens


class SelfAttention(nn.Module):
    """Multi-head self-attention through `scaled_dot_product_attention` (flash/efficient kernels)."""

    def __init__(self, dim: int, heads: int, dropout: float, causal: bool):
        super().__init__()
        builtin_args.require(
            "trainingrun_trainer.models.SelfAttention", dim=dim, heads=heads, dropout=dropout, causal=causal
        )
        self.heads = heads
        self.dropout = dropout
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=self.causal
        )
        return self.proj(y.transpose(1, 2).reshape(batch, length, dim))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); pre-norm trains stably without warmup."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, causal: bool = False):
        super().__init__()
        builtin_args.require(
            "trainingrun_trainer.models.TransformerBlock", dim=dim, heads=heads, dropout=dropout, causal=causal
        )
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout, causal)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x)))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class CharTransformer(nn.Module):
    """A small decoder-only (GPT-style) transformer over characters, trained on next-token loss.

    batch: `{"tokens": LongTensor[B, T + 1]}` with T <= context_length; position t predicts t + 1.
    Learned position embeddings. The output head is untied from the token embedding: tied weights
    are one parameter under two names, which complicates FSDP2 sharding (embedding and head live in
    different wrapped units) and state-dict checkpoints; at this size it costs nothing.
    """

    def __init__(
        self,
        vocab_size: int = 128,
        dim: int = 128,
        layers: int = 2,
        heads: int = 4,
        context_length: int = 64,
        dropout: float = 0.0,
    ):
        super().__init__()
        builtin_args.require(
            "trainingrun_trainer.models.CharTransformer", vocab_size=vocab_size, dim=dim, layers=layers, heads=heads,
            context_length=context_length, dropout=dropout,
        )  # fmt: skip
        self.vocab_size = vocab_size
        self.dim = dim
        self.context_length = context_length
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Embedding(context_length, dim)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, dropout, causal=True) for _ in range(layers))
        self.final_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        tokens = _checked_tokens(batch, self.context_length)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.size(1), device=tokens.device)
        x = self.embedding_dropout(self.token_embedding(inputs) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.final_norm(x))
        # The loss in float32 even under bf16 autocast: log-softmax over the vocab loses accuracy in bf16.
        return F.cross_entropy(logits.float().reshape(-1, self.vocab_size), targets.reshape(-1))

    def tokens_per_sample(self) -> int:
        return self.context_length

    def flops_per_sample(self) -> int:
        tokens = self.context_length
        return 6 * _matmul_weights(self) * tokens + _attention_flops(len(self.blocks), self.dim, tokens)


class MaskedAutoencoder(nn.Module):
    """A small masked autoencoder (He et al., 2021) on image patches.

    batch: `{"images": FloatTensor[B, C, H, W]}`. Each sample hides a random `mask_ratio` of its
    patches; the encoder sees only the visible ones, a light decoder fills in the rest from mask
    tokens, and the loss is the mean squared error on the hidden patches' pixels.

    `blocks` holds the encoder blocks followed by the decoder blocks (their widths differ, which
    per-block sharding and checkpointing do not mind), so the trainer treats both the same way.
    """

    def __init__(
        self,
        image_size: int = 32,
        patch_size: int = 4,
        channels: int = 3,
        dim: int = 128,
        layers: int = 2,
        heads: int = 4,
        decoder_dim: int = 64,
        decoder_layers: int = 1,
        mask_ratio: float = 0.75,
    ):
        super().__init__()
        builtin_args.require(
            "trainingrun_trainer.models.MaskedAutoencoder", image_size=image_size, patch_size=patch_size,
            channels=channels, dim=dim, layers=layers, heads=heads, decoder_dim=decoder_dim,
            decoder_layers=decoder_layers, mask_ratio=mask_ratio,
        )  # fmt: skip
        self.image_size = image_size
        self.patch_size = patch_size
        self.channels = channels
        self.dim = dim
        self.decoder_dim = decoder_dim
        self.encoder_layers = layers
        self.num_patches = (image_size // patch_size) ** 2
        # At least one patch visible and one hidden, whatever the ratio, so both halves have work.
        self.num_visible = min(max(1, round(self.num_patches * (1.0 - mask_ratio))), self.num_patches - 1)
        patch_dim = patch_size * patch_size * channels

        self.patch_embedding = nn.Linear(patch_dim, dim)
        self.position_embedding = nn.Parameter(torch.zeros(1, self.num_patches, dim))
        self.blocks = nn.ModuleList(
            [TransformerBlock(dim, heads) for _ in range(layers)]
            + [TransformerBlock(decoder_dim, heads) for _ in range(decoder_layers)]
        )
        self.encoder_norm = nn.LayerNorm(dim)
        self.decoder_embedding = nn.Linear(dim, decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_dim))
        self.decoder_position_embedding = nn.Parameter(torch.zeros(1, self.num_patches, decoder_dim))
        self.decoder_norm = nn.LayerNorm(decoder_dim)
        self.decoder_head = nn.Linear(decoder_dim, patch_dim)
        self.apply(_init_weights)
        for parameter in (self.position_embedding, self.mask_token, self.decoder_position_embedding):
            nn.init.normal_(parameter, std=0.02)

    def patchify(self, images: Tensor) -> Tensor:
        """[B, C, H, W] -> [B, patches, patch_size * patch_size * C], patches in row-major order."""
        batch = images.size(0)
        p, side = self.patch_size, self.image_size // self.patch_size
        x = images.reshape(batch, self.channels, side, p, side, p)
        return x.permute(0, 2, 4, 3, 5, 1).reshape(batch, side * side, p * p * self.channels)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        images = batch["images"]
        expected = (self.channels, self.image_size, self.image_size)
        _require(
            images.dim() == 4 and tuple(images.shape[1:]) == expected,
            f"images must be [batch, {', '.join(map(str, expected))}], got shape {tuple(images.shape)}",
        )
        # Pixels arrive float32; with bf16 weights (precision bf16-true) the matmuls need bf16 input.
        patches = self.patchify(images).to(self.patch_embedding.weight.dtype)
        batch_size = patches.size(0)

        # Per-sample random masking from the global RNG on the input's device, so the checkpointed
        # RNG state replays the same masks after a resume.
        noise = torch.rand(batch_size, self.num_patches, device=images.device)
        shuffle = noise.argsort(dim=1)
        restore = shuffle.argsort(dim=1)
        visible = shuffle[:, : self.num_visible]

        x = self.patch_embedding(patches) + self.position_embedding
        x = x.gather(1, visible.unsqueeze(-1).expand(-1, -1, x.size(-1)))
        for block in self.blocks[: self.encoder_layers]:
            x = block(x)
        x = self.decoder_embedding(self.encoder_norm(x))

        # Append one mask token per hidden patch, then put every patch back in its place.
        hidden_count = self.num_patches - self.num_visible
        x = torch.cat([x, self.mask_token.to(x.dtype).expand(batch_size, hidden_count, -1)], dim=1)
        x = x.gather(1, restore.unsqueeze(-1).expand(-1, -1, x.size(-1))) + self.decoder_position_embedding
        for block in self.blocks[self.encoder_layers :]:
            x = block(x)
        prediction = self.decoder_head(self.decoder_norm(x)).float()

        hidden = torch.ones(batch_size, self.num_patches, device=images.device)
        hidden.scatter_(1, visible, 0.0)
        per_patch_error = (prediction - patches.float()).pow(2).mean(dim=-1)
        return (per_patch_error * hidden).sum() / hidden.sum()

    def tokens_per_sample(self) -> int:
        return self.num_patches

    def flops_per_sample(self) -> int:
        def params(*modules: nn.Module) -> int:
            return sum(_matmul_weights(m) for m in modules)

        encoder_blocks = self.blocks[: self.encoder_layers]
        decoder_blocks = self.blocks[self.encoder_layers :]
        visible, everything = self.num_visible, self.num_patches
        # Each part counts the tokens that actually pass through it: the encoder sees visible patches. The patch
        # embedding's input is the image, which needs no gradient: forward and weight gradient only (4N, not 6N).
        matmul_flops = 4 * params(self.patch_embedding) * everything + 6 * (
            params(*encoder_blocks, self.encoder_norm, self.decoder_embedding) * visible
            + params(*decoder_blocks, self.decoder_norm, self.decoder_head) * everything
        )
        return (
            matmul_flops
            + _attention_flops(len(encoder_blocks), self.dim, visible)
            + _attention_flops(len(decoder_blocks), self.decoder_dim, everything)
        )


class HuggingFaceCausalLM(nn.Module):
    """A Hugging Face causal language model (what transformers' `AutoModelForCausalLM` builds for a config: GPT-2,
    Llama, Qwen, Mistral...) from random weights, under the model contract: the adapter most users otherwise write.

    `config_class`: its configuration class in transformers (`transformers.GPT2Config`, or `LlamaConfig`), and
    nothing outside that package; `config`: that class's arguments (`n_layer`, `hidden_size`, `vocab_size`...);
    `context_length`: the tokens a sample predicts, for tokens/s and model FLOPs (the dataset's own context length).
    batch: `{"tokens": LongTensor[B, T + 1]}` with T <= context_length, as the built-in text datasets give it: the
    model reads the first T tokens and the loss is the mean next-token cross entropy over the last T, in float32.
    `blocks` is the model's own list of decoder layers (found by its `_no_split_modules`), not a copy, so activation
    checkpointing and FSDP2 wrap the layers the model calls. Needs the `huggingface` extra (transformers).
    """

    def __init__(self, config_class: str, config: Optional[dict[str, Any]] = None, context_length: int = 64):
        super().__init__()
        builtin_args.require(
            "trainingrun_trainer.models.HuggingFaceCausalLM", config_class=config_class, config=config,
            context_length=context_length,
        )  # fmt: skip
        import transformers

        name = config_class.removeprefix("transformers.")
        found = getattr(transformers, name, None) if name.isidentifier() else None
        _require(
            isinstance(found, type) and issubclass(found, transformers.PretrainedConfig),
            f"configClass {config_class!r} is not a configuration class of transformers "
            f"{transformers.__version__}: name one such as transformers.GPT2Config or transformers.LlamaConfig",
        )
        assert isinstance(found, type)
        self.config = found(**(config or {}))
        try:
            self.model = transformers.AutoModelForCausalLM.from_config(self.config)
        except ValueError as error:  # a config transformers maps to no causal LM (e.g. BertConfig)
            raise ValueError(f"configClass {config_class!r}: {error}") from None
        self.context_length = context_length
        self._blocks_path = _decoder_layers(self.model)
        _require(
            self._blocks_path is not None,
            f"configClass {config_class!r}: {type(self.model).__name__} has no list of decoder layers this adapter "
            "can find (its _no_split_modules); write a wrapper that sets `blocks` (docs/training.md)",
        )

    @property
    def blocks(self) -> nn.ModuleList:
        """The model's decoder layers, the list it calls them from (registered once, under the model's own name)."""
        assert self._blocks_path is not None
        layers = self.model.get_submodule(self._blocks_path)
        assert isinstance(layers, nn.ModuleList)
        return layers

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        tokens = _checked_tokens(batch, self.context_length)
        logits = self.model(input_ids=tokens[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

    def tokens_per_sample(self) -> int:
        return self.context_length

    def flops_per_sample(self) -> int:
        """6 x the matmul weights x tokens, plus attention: every 2-D weight but the embeddings' (transformers' GPT-2
        has Conv1D layers, not nn.Linear), and the output head once when it is the token embedding, tied."""
        embeddings = {id(m.weight) for m in self.model.modules() if isinstance(m, nn.Embedding)}
        matmul = sum(p.numel() for p in self.model.parameters() if p.dim() == 2 and id(p) not in embeddings)
        head = self.model.get_output_embeddings()
        if head is not None and id(head.weight) in embeddings:
            matmul += head.weight.numel()
        hidden = int(getattr(self.config, "hidden_size", 0) or getattr(self.config, "n_embd", 0))
        return 6 * matmul * self.context_length + _attention_flops(len(self.blocks), hidden, self.context_length)


def _decoder_layers(model: nn.Module) -> Optional[str]:
    """The dotted name of the ModuleList holding `model`'s decoder layers: the longest list whose elements are all of
    the classes the model names in `_no_split_modules` (GPT2Block, LlamaDecoderLayer...)."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    lists = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and len(module) > 0
        and all(type(layer).__name__ in layer_classes for layer in module)
    ]
    return max(lists, key=lambda named: len(named[1]))[0] if lists else None

"""The shipped models follow the model contract, learn the shipped synthetic data, and are
deterministic under a seed (which exact resume relies on)."""

import importlib.util

import pytest
import torch

from trainingrun_trainer.data import SyntheticImages, SyntheticText
from trainingrun_trainer.models import CharTransformer, HuggingFaceCausalLM, MaskedAutoencoder, TransformerBlock

TINY_TEXT = dict(vocab_size=32, dim=32, layers=1, heads=2, context_length=16)
TINY_MAE = dict(image_size=16, patch_size=4, channels=3, dim=32, layers=1, heads=2, decoder_dim=32, decoder_layers=1)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and two threads on a busy 2-core machine take 3x longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def text_batch(batch_size=4, context_length=16, vocab_size=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(vocab_size, (batch_size, context_length + 1), generator=generator)}


def image_batch(batch_size=4, image_size=16, channels=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {"images": torch.rand(batch_size, channels, image_size, image_size, generator=generator) * 2 - 1}


TINY_GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 32, "n_positions": 16}
TINY_LLAMA = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
              "num_key_value_heads": 1, "vocab_size": 32, "max_position_embeddings": 16}  # fmt: skip
NEEDS_TRANSFORMERS = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed (the huggingface extra)"
)

CASES = [
    pytest.param(lambda: CharTransformer(**TINY_TEXT), text_batch, id="char-transformer"),
    pytest.param(lambda: MaskedAutoencoder(**TINY_MAE), image_batch, id="masked-autoencoder"),
    pytest.param(
        lambda: HuggingFaceCausalLM("transformers.GPT2Config", TINY_GPT2, context_length=16),
        text_batch,
        id="huggingface-gpt2",
        marks=NEEDS_TRANSFORMERS,
    ),
    pytest.param(
        lambda: HuggingFaceCausalLM("LlamaConfig", TINY_LLAMA, context_length=16),
        text_batch,
        id="huggingface-llama",
        marks=NEEDS_TRANSFORMERS,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("make_model,make_batch", CASES)
def test_contract(make_model, make_batch):
    torch.manual_seed(0)
    model = make_model()
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) >= 1
    assert isinstance(model.tokens_per_sample(), int) and model.tokens_per_sample() > 0
    assert isinstance(model.flops_per_sample(), int) and model.flops_per_sample() > 0

    loss = model(make_batch())
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("make_model,make_batch", CASES)
def test_deterministic_under_a_seed(make_model, make_batch):
    def run():
        torch.manual_seed(123)
        model = make_model()
        loss = model(make_batch())
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    (loss_a, grads_a), (loss_b, grads_b) = run(), run()
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@pytest.mark.parametrize("make_model,make_batch", CASES)
def test_bf16_autocast_forward_and_backward(make_model, make_batch):
    torch.manual_seed(0)
    model = make_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(make_batch())
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    torch.manual_seed(0)
    reference = make_model()(make_batch())
    assert abs(loss.item() - reference.item()) < 0.05 * max(1.0, reference.item())


@pytest.mark.parametrize("make_model,make_batch", CASES)
def test_bf16_weights_with_float32_inputs(make_model, make_batch):
    """precision bf16-true: the whole model in bf16, the batch as the dataset makes it."""
    torch.manual_seed(0)
    model = make_model().to(torch.bfloat16)
    loss = model(make_batch())
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()


@pytest.mark.parametrize("make_model,make_batch", CASES)
def test_activation_checkpointing_wrapper_gives_the_same_gradients(make_model, make_batch):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def gradients(wrap):
        torch.manual_seed(0)
        model = make_model()
        if wrap:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = checkpoint_wrapper(block)
        model(make_batch()).backward()
        return [p.grad for p in model.parameters()]

    for plain, wrapped in zip(gradients(False), gradients(True)):
        assert torch.allclose(plain, wrapped, atol=1e-6)


@pytest.mark.parametrize("make_model,make_batch", CASES)
def test_blocks_can_be_replaced_by_wrappers(make_model, make_batch):
    """The trainer wraps each block (activation checkpointing); forward must go through the list."""

    class Counting(torch.nn.Module):
        calls = 0

        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, *args, **kwargs):
            Counting.calls += 1
            return self.block(*args, **kwargs)

    torch.manual_seed(0)
    model = make_model()
    batch = make_batch()
    expected = model(batch).item()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = Counting(block)
    torch.manual_seed(0)
    make_model()  # same RNG position as before the first forward, for the MAE's masks
    assert model(batch).item() == pytest.approx(expected)
    assert Counting.calls == len(model.blocks)


def test_char_transformer_is_causal():
    """Changing a later token must not change the loss terms of earlier positions."""
    torch.manual_seed(0)
    model = CharTransformer(**TINY_TEXT).eval()
    tokens = text_batch(batch_size=1)["tokens"]
    changed = tokens.clone()
    changed[0, -2] = (changed[0, -2] + 1) % 32

    captured = []
    model.head.register_forward_hook(lambda module, inputs, output: captured.append(output))

    def per_position_loss(t):
        model({"tokens": t})
        return torch.nn.functional.cross_entropy(captured.pop()[0], t[0, 1:], reduction="none")

    a, b = per_position_loss(tokens), per_position_loss(changed)
    assert torch.allclose(a[:-2], b[:-2], atol=1e-6)
    assert not torch.allclose(a[-2:], b[-2:])


def test_char_transformer_accepts_shorter_sequences_and_rejects_longer():
    model = CharTransformer(**TINY_TEXT)
    assert torch.isfinite(model(text_batch(context_length=5)))
    with pytest.raises(ValueError, match=r"2 <= length <= context_length \+ 1 = 17, got shape \(4, 18\)"):
        model(text_batch(context_length=17))


def test_mae_masks_follow_the_global_rng():
    torch.manual_seed(0)
    model = MaskedAutoencoder(**TINY_MAE)
    batch = image_batch()
    state = torch.random.get_rng_state()
    first = model(batch)
    second = model(batch)
    torch.random.set_rng_state(state)
    assert torch.equal(model(batch), first)  # restoring the RNG replays the masks
    assert not torch.equal(first, second)  # and different draws mask differently


def test_mae_rejects_images_of_the_wrong_shape():
    model = MaskedAutoencoder(**TINY_MAE)
    with pytest.raises(ValueError, match=r"images must be \[batch, 3, 16, 16\], got shape \(2, 3, 8, 8\)"):
        model(image_batch(batch_size=2, image_size=8))


def test_mae_patchify_keeps_pixels():
    model = MaskedAutoencoder(**TINY_MAE)
    images = image_batch(batch_size=2)["images"]
    patches = model.patchify(images)
    assert patches.shape == (2, 16, 4 * 4 * 3)
    # Patch 1 is the top row, second column: pixels [0:4, 4:8], channel-last within the patch.
    assert torch.equal(patches[0, 1].view(4, 4, 3), images[0, :, 0:4, 4:8].permute(1, 2, 0))


def test_char_transformer_learns_synthetic_text():
    torch.manual_seed(0)
    dataset = SyntheticText(num_samples=2048, context_length=16, vocab_size=32)
    tokens = torch.stack([dataset[i]["tokens"] for i in range(len(dataset))])
    model = CharTransformer(**TINY_TEXT)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(300):
        loss = model({"tokens": tokens[torch.randint(len(tokens), (32,), generator=generator)]})
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    start, end = sum(losses[:10]) / 10, sum(losses[-20:]) / 20
    assert start > 3.0  # about ln(32) = 3.47: a uniform guess
    assert end < 1.6  # near the chain's entropy rate (about 1.1 nats)
    assert end < dataset.entropy_rate() + 0.5


def test_masked_autoencoder_learns_synthetic_images():
    torch.manual_seed(0)
    dataset = SyntheticImages(num_samples=512, image_size=16)
    images = torch.stack([dataset[i]["images"] for i in range(len(dataset))])
    model = MaskedAutoencoder(**TINY_MAE)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(150):
        loss = model({"images": images[torch.randint(len(images), (32,), generator=generator)]})
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    start, end = sum(losses[:10]) / 10, sum(losses[-20:]) / 20
    assert end < 0.5 * start


def test_fewer_visible_patches_mean_fewer_flops():
    model = CharTransformer(**TINY_TEXT)
    assert model.tokens_per_sample() == 16
    mae = MaskedAutoencoder(**TINY_MAE)
    assert mae.tokens_per_sample() == 16
    # Fewer visible patches means less encoder work.
    assert MaskedAutoencoder(**TINY_MAE, mask_ratio=0.9).flops_per_sample() < mae.flops_per_sample()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(dim=30, heads=4), r"dim \(30\) must be divisible by heads \(4\)"),
        (dict(layers=0), r"layers must be a positive integer, got 0"),
        (dict(vocab_size=1), r"vocab_size must be an integer of at least 2, got 1"),
        (dict(dropout=1.0), r"dropout must be a number in \[0, 1\), got 1.0"),
        (dict(context_length=-1), r"context_length must be a positive integer, got -1"),
    ],
)
def test_char_transformer_bad_args(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CharTransformer(**kwargs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(image_size=30, patch_size=4), r"image_size \(30\) must be divisible by patch_size \(4\)"),
        (dict(dim=30, heads=4), r"dim \(30\) must be divisible by heads \(4\)"),
        (dict(decoder_dim=30, heads=4), r"decoder_dim \(30\) must be divisible by heads \(4\)"),
        (dict(mask_ratio=0.0), r"mask_ratio must be a number between 0 and 1 \(exclusive\), got 0.0"),
        (dict(mask_ratio=1.0), r"mask_ratio must be a number between 0 and 1 \(exclusive\), got 1.0"),
        (dict(image_size=4, patch_size=4), r"masking needs 2\+ patches"),
    ],
)
def test_masked_autoencoder_bad_args(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MaskedAutoencoder(**kwargs)


def test_transformer_block_keeps_shape():
    block = TransformerBlock(dim=16, heads=2, causal=True)
    x = torch.randn(2, 5, 16)
    assert block(x).shape == x.shape


def test_dropout_is_off_in_eval_mode():
    torch.manual_seed(0)
    model = CharTransformer(**TINY_TEXT, dropout=0.5).eval()
    batch = text_batch()
    assert torch.equal(model(batch), model(batch))


@pytest.mark.parametrize(
    "make_model,make_batch",
    [
        pytest.param(
            lambda: CharTransformer(vocab_size=64, dim=64, layers=2, heads=4, context_length=32),
            lambda: text_batch(batch_size=3, context_length=32, vocab_size=64),
            id="char-transformer",
        ),
        pytest.param(lambda: MaskedAutoencoder(**TINY_MAE), lambda: image_batch(batch_size=3), id="masked-autoencoder"),
    ],
)
def test_flops_per_sample_is_what_torch_counts_for_a_forward_and_backward_pass(make_model, make_batch):
    """The MFU numerator: the count of torch's FlopCounterMode (attention through SDPA's math path, whose matmuls it
    sees) over the samples of a batch."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = make_model()
    batch = make_batch()
    samples = next(iter(batch.values())).shape[0]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(batch).backward()
    assert model.flops_per_sample() == pytest.approx(counter.get_total_flops() / samples, rel=0.01)


@NEEDS_TRANSFORMERS
def test_the_huggingface_adapter_uses_the_models_own_layers_and_counts_conv1d_flops():
    torch.manual_seed(0)
    model = HuggingFaceCausalLM("transformers.GPT2Config", TINY_GPT2, context_length=16)
    assert model.blocks is model.model.transformer.h  # the list the model calls, not a copy
    assert not any(name.startswith("blocks.") for name in model.state_dict())  # registered once
    # GPT-2's layers are Conv1D, not nn.Linear: 2 layers x (4 x 32 x 32 attention + 8 x 32 x 32 MLP), and the
    # output head, tied to the token embedding (32 x 32), once.
    matmul = 2 * (4 + 8) * 32 * 32 + 32 * 32
    assert model.flops_per_sample() >= 6 * matmul * 16


@NEEDS_TRANSFORMERS
@pytest.mark.parametrize(
    "config_class,message",
    [
        ("transformers.AutoModel", "is not a configuration class of transformers"),
        ("NoSuchConfig", "is not a configuration class of transformers"),
        ("os.system", "config_class must be a configuration class of transformers"),
    ],
)
def test_the_huggingface_adapter_refuses_what_is_not_a_transformers_config(config_class, message):
    with pytest.raises(ValueError, match=message):
        HuggingFaceCausalLM(config_class, {}, context_length=16)

import pytest
import torch

from pipeswift_lab import models


@pytest.mark.parametrize("name", ["gpt", "vit", "mlp"])
def test_reference_setups_train(name):
    setup = models.reference(name, batch_size=4)
    out = setup.model(setup.inputs)
    loss = setup.loss_fn(out, setup.targets)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for p in setup.model.parameters())
    assert isinstance(setup.model, torch.nn.Sequential)


def test_gpt_layers_and_imbalance():
    model = models.gpt(vocab_size=4096, n_layers=3)
    names = [n for n, _ in model.named_children()]
    assert names == ["embed", "block_0", "block_1", "block_2", "head"]
    params = {n: sum(p.numel() for p in m.parameters()) for n, m in model.named_children()}
    assert params["head"] > 2 * params["block_0"]
    assert max(params, key=params.get) in ("embed", "head")
    tokens, targets = models.gpt_batch(2, 64, 4096)
    assert model(tokens).shape == (2, 64, 4096)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])


def test_vit_and_mlp_shapes():
    model = models.vit(image_size=16, patch_size=4, n_layers=2, num_classes=10)
    images, labels = models.vit_batch(3, 16, 3, 10)
    assert model(images).shape == (3, 10)
    assert [n for n, _ in model.named_children()] == ["patch_embed", "block_0", "block_1", "head"]
    net = models.mlp([8, 16, 4])
    assert [n for n, _ in net.named_children()] == ["layer_0", "layer_1"]
    assert net(torch.zeros(2, 8)).shape == (2, 4)


def test_seeded_and_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = models.gpt(n_layers=1, seed=7)
    assert torch.equal(torch.rand(3), expected)
    b = models.gpt(n_layers=1, seed=7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_device_and_dtype():
    model = models.mlp([4, 4], dtype=torch.float64, device="cpu")
    assert next(model.parameters()).dtype == torch.float64


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: models.gpt(d_model=10, n_heads=4), ValueError, "d_model=10 must be divisible by n_heads=4"),
        (lambda: models.gpt(n_layers=0), ValueError, "n_layers=0 is invalid"),
        (lambda: models.mlp([4]), ValueError, r"widths=\[4\] needs at least 2 entries"),
        (
            lambda: models.vit(image_size=30, patch_size=4),
            ValueError,
            "image_size=30 must be divisible by patch_size=4",
        ),
        (
            lambda: models.reference("resnet"),
            ValueError,
            r"name='resnet' is not known; valid reference models are \['gpt', 'vit', 'mlp'\]",
        ),
        (lambda: models.reference("gpt", batch_size=0), ValueError, "batch_size=0 is invalid"),
    ],
)
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()

"""Whole models: a 2-layer TransformerEncoder (d_model 64, eval mode), a small CNN (Conv2d,
BatchNorm2d, ReLU, pooling, Linear) in eval and in train mode, and torchvision's resnet18 when
torchvision imports. Inputs are small so that the demo stays quick on a 2-core machine.
In train mode BatchNorm2d updates its running statistics in place: a compiled call must leave the
same buffers as an eager call.
"""
import torch


def transformer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    return model.eval()


class SmallCNN(torch.nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(16)
        self.pool = torch.nn.MaxPool2d(2)
        self.gap = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(16, classes)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = self.gap(x).flatten(1)
        return self.fc(x)


def cnn(train):
    torch.manual_seed(0)
    m = SmallCNN()
    return m.train() if train else m.eval()


def _resnet18():
    try:
        import torchvision
    except Exception as e:  # ImportError, or a torchvision built for another torch
        return None, f"torchvision does not import ({type(e).__name__}: {e})"
    torch.manual_seed(0)
    return torchvision.models.resnet18().eval(), None


def skipped():
    """(name, why) for cases this machine cannot run."""
    _, why = _resnet18()
    return [("resnet18", why)] if why else []


def cases():
    torch.manual_seed(0)
    seq = torch.randn(2, 5, 64)
    img = torch.randn(2, 3, 16, 16)
    out = [
        ("transformer_encoder", transformer(), [(seq,), (seq * 0.5,)]),
        ("cnn_eval", cnn(False), [(img,), (img + 1.0,)]),
        ("cnn_train", cnn(True), [(img,), (img + 1.0,)]),
    ]
    model, _ = _resnet18()
    if model is not None:
        out.append(("resnet18", model, [(torch.randn(1, 3, 32, 32),)]))
    return out

"""The ResNet-50 backbone of the end-to-end small-batch row: torchvision's ``resnet50()`` where
torchvision is installed, otherwise the same architecture built here (the bottleneck blocks,
strides and initialization of torchvision's ResNet v1.5), so that the row runs on a machine with
PyTorch alone. Either way the classifier is dropped (``fc`` = Identity): the backbone returns the
pooled 2048 features an SSL head reads.

``width`` scales every layer's channels (64 = ResNet-50; the CPU dry run uses 8), so the features
are ``32 * width`` wide.
"""

from __future__ import annotations

from torch import nn


class Bottleneck(nn.Module):
    """torchvision's Bottleneck: 1x1 -> 3x3 (the stride, as v1.5 puts it) -> 1x1 (x4 channels),
    BatchNorm2d and ReLU after each, the shortcut projected where the shape changes."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                         nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet50(nn.Module):
    """torchvision.models.resnet50's layers (3, 4, 6, 3 bottlenecks), without its classifier."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        layers, cin = [], width
        for i, blocks in enumerate((3, 4, 6, 3)):
            w = width * 2**i
            stage = []
            for b in range(blocks):
                stage.append(Bottleneck(cin, w, stride=2 if b == 0 and i > 0 else 1))
                cin = w * Bottleneck.expansion
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Identity()
        for m in self.modules():  # torchvision's initialization
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet50(width: int = 64) -> tuple[nn.Module, str]:
    """(the backbone, where it came from: "torchvision" or "benchmarks.resnet")."""
    if width == 64:
        try:
            import torchvision
        except ImportError:
            pass
        else:
            model = torchvision.models.resnet50()
            model.fc = nn.Identity()
            return model, "torchvision"
    return ResNet50(width), "benchmarks.resnet"

"""A tiny LightningModule for tests that need a real Trainer but no particular model: two FP8
candidate layers, a loss from the batch alone, and a count of the training steps that ran."""

import lightning as L
import torch
from torch import nn


class CountingMLP(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

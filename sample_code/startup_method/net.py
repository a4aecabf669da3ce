"""Data-parallel training with MindSpore, as in the msrun manual - on random data (no downloads).

Run it with ``bash msrun_single.sh`` (needs ``pip install mindspore==2.10.0 "numpy<2"``).
"""

import os

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
init()
ms.set_seed(1)

EPOCHS = int(os.environ.get("EPOCHS", "1"))
SAMPLES = int(os.environ.get("SAMPLES", "1024"))


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc = nn.Dense(28 * 28, 10, weight_init="normal", bias_init="zeros")
        self.relu = nn.ReLU()

    def construct(self, x):
        x = self.flatten(x)
        logits = self.relu(self.fc(x))
        return logits


def create_dataset(batch_size):
    """Random MNIST-shaped images and labels; each rank gets its own shard."""
    rank_id, rank_size = get_rank(), get_group_size()
    rng = np.random.default_rng(1234)
    images = rng.random((SAMPLES, 1, 28, 28), dtype=np.float32)
    labels = rng.integers(0, 10, size=(SAMPLES,)).astype(np.int32)
    dataset = ds.NumpySlicesDataset(
        {"image": images, "label": labels}, shuffle=False, num_shards=rank_size, shard_id=rank_id
    )
    return dataset.batch(batch_size)


net = Network()
data_set = create_dataset(32)
loss_fn = nn.CrossEntropyLoss()
optimizer = nn.SGD(net.trainable_params(), 1e-2)


def forward_fn(data, label):
    logits = net(data)
    loss = loss_fn(logits, label)
    return loss, logits


grad_fn = ms.value_and_grad(forward_fn, None, net.trainable_params(), has_aux=True)
grad_reducer = nn.DistributedGradReducer(optimizer.parameters)

for epoch in range(EPOCHS):
    for i, (image, label) in enumerate(data_set):
        (loss_value, _), grads = grad_fn(image, label)
        grads = grad_reducer(grads)
        optimizer(grads)
        if i % 10 == 0:
            print(f"epoch: {epoch}, step: {i}, loss is {loss_value}")

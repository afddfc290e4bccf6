"""The data: CIFAR-10 read on the host (cifar10.py) and downloaded (download.py), and the
on-device augmentation the training step runs (augment.py: flip, crop, mixup / CutMix;
randaugment.py: RandAugment)."""

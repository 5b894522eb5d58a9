"""``python -m fp8_plugin``: which FP8 recipes run natively on this machine."""

from .numerics.device import describe_device

if __name__ == "__main__":
    print(describe_device())

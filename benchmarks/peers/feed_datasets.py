"""The peers' transform, and litdata's and mosaicml-streaming's datasets giving (image, class, key) with
it, for `feed.py`: in a module of their own so that the workers those libraries spawn can import them
(a class defined in the script or in a function cannot be unpickled there)."""

import io

import litdata
import streaming
from PIL import Image
from torchvision.transforms import v2

SIZE = 224
TRANSFORM = v2.Compose(
    [v2.PILToTensor(), v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip()]
)


def decode(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


class LitdataImages(litdata.StreamingDataset):
    def __getitem__(self, index):
        item = super().__getitem__(index)
        return TRANSFORM(decode(item["jpg"])), item["cls"], item["key"]


class MosaicImages(streaming.StreamingDataset):
    def __getitem__(self, index):
        item = super().__getitem__(index)
        return TRANSFORM(decode(item["jpg"])), item["cls"], item["key"]

"""litdata's and mosaicml-streaming's datasets giving (image, class) for `feed.py`, in a module of their
own so that the workers those libraries spawn can import them (a class defined in the script or in a
function cannot be unpickled there)."""

import litdata
import streaming
from feed import TRANSFORM, decode


class LitdataImages(litdata.StreamingDataset):
    def __getitem__(self, index):
        item = super().__getitem__(index)
        return TRANSFORM(decode(item["jpg"])), item["cls"], item["key"]


class MosaicImages(streaming.StreamingDataset):
    def __getitem__(self, index):
        item = super().__getitem__(index)
        return TRANSFORM(decode(item["jpg"])), item["cls"], item["key"]

"""`hf:DIR`: a local snapshot of a Hugging Face Hub dataset repository in parquet. The reader,
`ssl_vit.data.hf_source`, imports pyarrow: it is imported when the source is read."""

from __future__ import annotations

from ssl_vit.data.sources import Flag, register


@register(
    "hf",
    argument="DIR",
    help="a local snapshot of a Hugging Face Hub dataset repository in parquet, as `huggingface-cli "
    "download --repo-type dataset ORG/NAME --local-dir DIR` leaves it: the image and label columns found "
    "from its `datasets` Image and ClassLabel features, or named",
    splits="train|validation|test|..., the repository's own",
    flags=(
        Flag(
            "subset",
            "the configuration (subset) to read, one of the README's configs: or a top folder; default: the "
            "only one, or the one marked default",
            metavar="NAME",
        ),
        Flag(
            "image_column",
            "the column of images (encoded image files, or the `datasets` Image struct); default: the "
            "column the `datasets` features mark as Image",
            metavar="NAME",
        ),
        Flag(
            "label_column",
            "the column of integer labels; default: the column the `datasets` features mark as ClassLabel "
            "(its names become the class names), else none (unlabelled)",
            metavar="NAME",
        ),
    ),
)
def load(arg: str, split: str, subset: str | None, image_column: str | None, label_column: str | None):
    from ssl_vit.data import hf_source

    return hf_source.load(arg, split, image_column, label_column, subset)

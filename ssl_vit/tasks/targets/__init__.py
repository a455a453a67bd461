"""The masked-prediction targets, one module each (`ssl_vit/tasks/target.py` says what a target is).
Importing this package registers them all (`ssl_vit.tasks.target.TARGETS`), in the order messages list
them."""

# isort: off
from ssl_vit.tasks.targets import color3bit_target, color3bit_4x4_target, pixels_target  # noqa: F401
from ssl_vit.tasks.targets import norm_pixels_target, hog_target, teacher_target  # noqa: F401

# isort: on

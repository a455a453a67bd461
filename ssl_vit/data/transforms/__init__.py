"""Image transforms, above `format` and below `stream`: the presets from an opened PIL image to a uint8
tensor [3, H, W] in the workers (`rgb`: `pretrain`, `supervised`, `eval`), the presets for images
read as arrays of any band count (`bands`), and mixup, cutmix and label smoothing of whole batches on
the device (`mixing`)."""

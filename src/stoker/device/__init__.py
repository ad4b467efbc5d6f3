"""The device wing: where batches go after the CPU (`DeviceOptions`, the copy stream `DeviceStage`),
the device thread that builds them there (`feeder.Feeder` running `build.DeviceBuilder`), GPU JPEG
decode, and `prefetch()` for any DataLoader."""

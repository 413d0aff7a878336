"""model: networks, torchvision backbones, augmentation and the LightningModule."""

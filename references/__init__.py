"""The truth: format specs, readable pack/unpack and encode/decode, the fp32 reference model."""

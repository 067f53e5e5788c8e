"""The PyTorch side: models bound to flat buffers, data sets, the learner loop."""

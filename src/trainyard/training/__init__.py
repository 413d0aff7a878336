"""train: the fit as named steps, the Trainer builder, resume and the input-bound meter."""

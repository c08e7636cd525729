"""Small building blocks of the model, one class per file."""

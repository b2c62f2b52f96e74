"""stagesave for PyTorch Lightning (``pip install 'stagesave[lightning]'``)."""

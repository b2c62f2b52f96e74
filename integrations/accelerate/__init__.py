"""stagesave for Hugging Face Accelerate (``pip install 'stagesave[accelerate]'``)."""

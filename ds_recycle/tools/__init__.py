"""Small command-line tools that stand beside training (``ds-recycle compare``)."""

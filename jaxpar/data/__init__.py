"""Tokens in: the corpus and its batches (:mod:`~jaxpar.data.loader`), Hugging Face
tokenizers and the token cache (:mod:`~jaxpar.data.tokenizer`).
"""

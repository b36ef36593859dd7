"""Tokens in: the corpus and its batches (:mod:`~jaxpar.data.loader`), Hugging Face
tokenizers and the token cache (:mod:`~jaxpar.data.tokenizer`), token shards
(:mod:`~jaxpar.data.shards`) read in shuffled, weighted epochs
(:mod:`~jaxpar.data.mixture`), and text tokenized into shards ahead of training
(:mod:`~jaxpar.data.tokenize_shards`).
"""

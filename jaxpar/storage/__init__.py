"""Files on disk, below everything that writes them: output folders with one writer,
swapped in whole, write faults named (:mod:`~jaxpar.storage.folders`); safetensors read a
slice at a time and written a shard at a time (:mod:`~jaxpar.storage.safetensors_io`).
"""

"""Changing a model after it is built: LoRA adapters (:mod:`jaxpar.adapters.lora`), a frozen
base in bfloat16 or int8 (:mod:`~jaxpar.adapters.quant`) and the module surgery both use
(:mod:`~jaxpar.adapters.surgery`).
"""

"""Capacity (StreamRL §4.2, §6): how many resources each stage gets.

``allocator`` splits a cluster between generation and training from the profiles; ``elastic``
adds or removes generator instances while training runs.
"""

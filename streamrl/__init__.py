"""streamrl"""

"""Conversations in, token ids + loss masks out."""

"""Image -> label map: settings, preprocessing, windows, label maps, the `Segmenter`, vocabularies, regions.

May import `models`, `attention`, `stages`, `runtime`."""

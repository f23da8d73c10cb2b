"""Translation: the source's KV through the bridge into the target's cache layout.

translator  Translator: one cache's layout (native head, translated columns, held-back tail)
            and any target layer's KV from the source's
layers      the arithmetic of one layer (LayerPlan, translate_layer: kernels.map_heads) or of a
            stack of layers (StackedPlan, translate_layers: kernels.map_layers)
grouped     LayerGroups: layers that keep the same rows translated in one launch pair
"""

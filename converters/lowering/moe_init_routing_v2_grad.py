LOWERS = ("MoeInitRoutingV2Grad",)


def body(b, node):
    raise NotImplementedError

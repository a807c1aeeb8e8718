LOWERS = ("MoeInitRoutingV2",)


def body(b, node):
    raise NotImplementedError

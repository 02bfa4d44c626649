class Net:
    def __init__(self, layers: int = 2):
        pass

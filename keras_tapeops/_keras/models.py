"""Private Keras model classes and entry points, isolated here."""


def functional_class():
    """Keras's functional model class (`keras.src.models.functional.Functional`).

    Keras 3 exports no public name for it (`keras.Model(inputs, outputs)`
    returns an instance of it through `Model.__new__`); a functional-built
    model, or a subclass of one, has it in its MRO. Its module path is the
    same in Keras 3.10 to 3.15.
    """
    from keras.src.models.functional import Functional

    return Functional


def unpickle_model(bytesio):
    """Loads a model pickled by Keras (`KerasSaveable._unpickle_model`).

    `KerasSaveable.__reduce__` pickles a model as its saved `.keras` bytes
    plus this private classmethod, its unpickling entry point (kept stable
    for old pickles in Keras 3.10 to 3.15). It does not depend on the class
    it is called on; Keras exports no public function for it.
    """
    import keras

    return keras.Model._unpickle_model(bytesio)

from imagenet_elastic.cli import program

if __name__ == "__main__":
    program()

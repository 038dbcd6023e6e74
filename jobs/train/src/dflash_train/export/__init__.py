"""`dflash-train export`: its config, the export format engines load, its files and the stage."""
